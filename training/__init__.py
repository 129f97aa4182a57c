"""What a training run needs besides the model and the data, shared by train.py, sample.py,
profile_train.py and the scripts: the step and its optimizer, a run's set-up and its loop, the
run config, run directories and checkpoints, the device and host runtime, and which attention
variants run."""
