"""What a training run needs besides the model and the data, shared by train.py, sample.py and
profile_train.py: the step and its optimizer, the loop, run config, run directories and
checkpoints, the device runtime, and the terminal side of every command. Imports nothing here:
`data/prepare.py` takes `training.console` without torch."""
