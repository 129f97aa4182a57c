"""Generate text from a trained run.

    python sample.py --run runs/default --prompt "def" [--tokens 200] [--temperature 0.8]
        [--top-k 50] [--top-p 0.95] [--stop-at-eot] [--attention sdpa] [--dtype float32]
        [--no-token-healing]

Reads the run's checkpoint, config and tokenizer (train.py copies it into the run directory).
In a prompt, "<|endoftext|>" is the document separator (in the corpus the same characters were
plain text), so `--prompt "<|endoftext|>"` starts a new document. Generation runs on past a
sampled separator into the next document, as training saw them, unless --stop-at-eot ends
the text there. The prompt's last token is sampled again among the tokens that start with
its text (token healing), so a prompt that ends mid-token, as "x = " does in a lone space,
continues as the corpus would; --tokens counts that token.

Attention holds no weights, so a run can be sampled with another variant than it trained
with (--attention), e.g. a GPU run's sdpa-cudnn on a CPU: every variant computes the same
function, to rounding. It samples in the run's precision as the device reads it (train.dtype
"auto": bf16 autocast on CUDA from Ampere on, fp32 elsewhere) unless --dtype says otherwise:
a CPU run's float32, say, on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from console import StdoutClosed, cannot_show, cli_path, is_utf8, say, stdout_closed
from data.meta import EOT, file_sha256
from model import GPT, VARIANTS
from training.checkpoint import (
    CHECKPOINT,
    CheckpointError,
    first_non_finite,
    load_checkpoint,
    model_config_diff,
    restoring,
)
from training.config import DTYPES, Config, ConfigError, build_config
from training.probe import VariantUnavailable, check_variant
from training.rundir import MAKE_TRAIN_RUN, lock_holder, saved_config
from training.runtime import (
    autocast,
    autocast_dtype,
    missing_bf16_instructions,
    missing_tensor_cores,
    pick_device,
    set_fp32_matmul_precision,
)


class SampleError(RuntimeError):
    """A run that cannot be sampled as asked; the message says what and where."""


# Errors a user's input causes: a one-line message, not a traceback.
USER_ERRORS = (SampleError, ConfigError, CheckpointError)


def _train_first(run_dir: Path) -> str:
    """The command that trains there: a run stopped before its first checkpoint starts over
    with the settings its config.toml holds; a new one with `make train`'s config, not
    train.py's built-in defaults."""
    saved = run_dir / "config.toml"
    config = saved if saved.is_file() else Path("configs/default.toml")
    command = (
        f"python train.py --config {shlex.quote(str(config))} --out {shlex.quote(str(run_dir))}"
    )
    if run_dir == MAKE_TRAIN_RUN:
        command = "make train"
    return f"train it first ({command}), or give --run the folder of a run"


def sampling_precision(config: Config, device: torch.device, dtype: str | None) -> Config:
    """The config with the precision to sample in: `dtype` if given, else the run's. On a GPU
    without the tensor cores it needs (before Ampere), a given one is an error; on a CPU without
    bf16 instructions, a given bfloat16 runs, warned. On either, the run's own gives way to
    float32, said."""
    if dtype is not None:
        config = replace(config, train=replace(config.train, dtype=dtype))
    missing = missing_tensor_cores(config.train.dtype, device)
    slow = config.train.dtype == "bfloat16" and missing_bf16_instructions(device, torch.bfloat16)
    if missing is None and not slow:
        return config
    if dtype is not None:
        if slow:
            print(f"warning: --dtype {dtype}: {slow}", file=sys.stderr)
            return config
        raise SampleError(f"--dtype {dtype} {missing}; use float32")
    # The run's own precision, which this device lacks: fp32 computes the same function.
    why = f"which {missing}" if missing else f"but {slow} (--dtype bfloat16 to insist)"
    print(
        f"note: the run trained in {config.train.dtype}, {why}; sampling in float32",
        file=sys.stderr,
    )
    return replace(config, train=replace(config.train, dtype="float32"))


def load_run(
    run_dir: Path, device: torch.device, attention: str | None = None, dtype: str | None = None
) -> tuple[GPT, Tokenizer, Config]:
    """The run's model on `device`, with its own attention variant or `attention`; the config
    returned holds the precision to sample in, the run's train.dtype or `dtype`."""
    if run_dir.is_file():
        raise SampleError(f"--run {run_dir} is a file; give the run directory ({run_dir.parent})")
    if run_dir.exists() and not run_dir.is_dir():  # /dev/null, a pipe
        raise SampleError(f"--run {run_dir} is neither a file nor a folder; give a run directory")
    if not run_dir.is_dir():
        raise SampleError(f"run directory {run_dir} does not exist; {_train_first(run_dir)}")
    if (run_dir / "meta.json").is_file():  # it has a tokenizer.json too, but no run
        raise SampleError(
            f"--run {run_dir} is a prepared corpus, not a run; give --run the folder train.py "
            f"wrote (--out, by default runs/<config>: {MAKE_TRAIN_RUN} for make train)"
        )
    if (run_dir / "results.json").is_file():
        raise SampleError(
            f"--run {run_dir} is a profile sweep's folder (results.json), not a run; give --run "
            f"the folder train.py wrote (--out, by default runs/<config>: {MAKE_TRAIN_RUN} for "
            "make train)"
        )
    ckpt_path = run_dir / CHECKPOINT
    tokenizer_path = run_dir / "tokenizer.json"
    # A run not there yet: training, or stopped before its first checkpoint. The lock is a
    # sweep's too, and a run copies its tokenizer in only after its set-up.
    if not ckpt_path.exists() and (pid := lock_holder(run_dir)) is not None:
        who = (
            f"the run is training (pid {pid})"
            if tokenizer_path.is_file()
            else f"pid {pid} holds it (a run starting, or a profile sweep writing there)"
        )
        raise SampleError(
            f"no checkpoint at {ckpt_path} yet: {who}; a run saves one at each evaluation "
            "(train.eval_interval) and at its end; sample it then"
        )
    if not tokenizer_path.is_file():
        raise SampleError(
            f"{run_dir} has no tokenizer.json; is it a run directory written by train.py?"
        )
    if not ckpt_path.exists():
        raise SampleError(f"no checkpoint at {ckpt_path}; {_train_first(run_dir)}")
    ckpt = load_checkpoint(ckpt_path, needs=("model",))  # the rest is resuming's
    config_path = run_dir / "config.toml"
    recorded = ckpt.get("config")
    recorded = recorded if isinstance(recorded, dict) else None
    raw = saved_config(run_dir, recorded, to="sample")
    if raw is None:  # as resuming does: the config the checkpoint records
        if recorded is None:
            raise SampleError(f"{run_dir} has no config.toml, and {ckpt_path} records no config")
        config = build_config(recorded, source=f"the config {ckpt_path} records")
    else:
        config = build_config(raw, source=str(config_path))
    # The weights may fit a config.toml edited after training (n_head, say) and still compute
    # another function: the checkpoint's own config, if it has one, decides.
    diff = model_config_diff(ckpt, asdict(config.model), now="in config.toml")
    if diff:
        raise CheckpointError(f"{config_path} does not match {ckpt_path}: {diff}")
    # Another tokenizer.json would decode the same ids into other text, without an error.
    trained_with = ckpt.get("tokenizer_sha256")
    try:
        tokenizer_hash = file_sha256(tokenizer_path)
    except OSError as e:
        raise SampleError(f"cannot read {tokenizer_path} ({e.strerror or e})") from None
    if trained_with is not None and tokenizer_hash != trained_with:
        corpus = config.data.dir / "tokenizer.json"
        raise CheckpointError(
            f"{tokenizer_path} is not the tokenizer {ckpt_path} was trained with (sha256 "
            f"{trained_with[:12]}); copy that corpus's back (it was {corpus}, if unchanged since)"
        )
    config = sampling_precision(config, device, dtype)
    if attention is not None:
        # Dropout off too: sampling never applies it, and flex, which has none, would refuse
        # a run trained with it.
        config = replace(config, model=replace(config.model, attention=attention, dropout=0.0))
    try:
        # Forward only, as sampling runs it: flex samples on a CPU, where it cannot train.
        check_variant(
            config.model.attention,
            device,
            autocast_dtype(config.train.dtype, device) or torch.float32,
            config.model.head_size,
            backward=False,
        )
    except VariantUnavailable as e:
        other = "naive" if config.model.attention == "sdpa" else "sdpa"
        # Off CUDA, a CUDA-only variant runs in no dtype: only another variant helps.
        cuda_only = device.type != "cuda" and VARIANTS[config.model.attention].cuda_only_reason
        ways = (
            [f"another variant, e.g. --attention {other}"] if attention is None or cuda_only else []
        )
        ways += [f"another --dtype than {dtype}"] if dtype is not None and not cuda_only else []
        hint = f"; sample with {' or '.join(ways)}" if ways else ""
        raise SampleError(f"{e}{hint}") from None
    model = GPT(config.model)
    with restoring(ckpt_path, "model"):
        model.load_state_dict(ckpt["model"])
    # train.py never saves them (it stops at the first NaN): edited, or written by another program
    broken = first_non_finite(model)
    if broken is not None:
        raise CheckpointError(f"{ckpt_path} holds NaN or infinite weights, in {broken}")
    return model.to(device).eval(), Tokenizer.from_file(str(tokenizer_path)), config


def sample_run(
    run_dir: Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 0,
    device: str = "auto",
    device_setting: str = "train.device",
    stop_at_eot: bool = False,
    attention: str | None = None,
    dtype: str | None = None,
    token_healing: bool = True,
    stream: Callable[[str], None] | None = None,
) -> str:
    """Text continuing `prompt`, up to the first sampled separator if `stop_at_eot`, with the
    run's attention variant or `attention`, in its precision or `dtype` (one of config.DTYPES),
    the prompt's last token healed (see `heal`) unless not `token_healing`.
    `device_setting` is what an error calls the device choice. `stream` is given the text in
    pieces as it is sampled, the prompt first; together they are the text returned."""
    dev = pick_device(device, device_setting)
    if dtype == "tf32" and dev.type != "cuda":  # before the checkpoint is read
        raise SampleError(f"--dtype tf32: TF32 is a CUDA mode, and this samples on {dev}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # a shell's undecodable bytes, as surrogates
        raise SampleError(f"--prompt {prompt!r} is not UTF-8 text ({e.reason})") from None
    model, tokenizer, config = load_run(run_dir, dev, attention, dtype)
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise SampleError("the prompt is empty; give at least one character")
    block = config.model.block_size
    if len(ids) > block:  # generate crops the context to it, as the model was trained
        print(
            f"note: the prompt is {len(ids)} tokens, and the model sees its last {block} "
            "(model.block_size): the text before them does not shape what follows",
            file=sys.stderr,
        )
    first_allowed = None
    # Shown first, whole, also where healing drops its last token: Ctrl-C before the first
    # draw then keeps the prompt as typed
    prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
    if token_healing and max_new_tokens > 0:
        ids, first_allowed = heal(tokenizer, ids)
    generator = torch.Generator(device=dev).manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=dev)
    eot = tokenizer.token_to_id(EOT) if stop_at_eot else None
    # A tf32 run samples with TF32 on CUDA; elsewhere in IEEE fp32, as it cannot train there
    set_fp32_matmul_precision(config.train.dtype if dev.type == "cuda" else "float32", dev)
    shown = Shown(tokenizer, ids, eot, stream, prompt_text)
    # The run's train.dtype as this device reads it ("auto": bf16 on CUDA from Ampere on, fp32
    # on a CPU).
    with autocast(dev, autocast_dtype(config.train.dtype, dev)):
        out = model.generate(
            idx,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            stop_id=eot,
            logits_hook=logits_hook(
                tokenizer.get_vocab_size(), config.model.vocab_size, first_allowed
            ),
            on_token=shown.add if stream is not None else None,
        )
    new = out[0, len(ids) :].tolist()
    if eot in new:
        new = new[: new.index(eot)]
    text = tokenizer.decode(ids + new, skip_special_tokens=False)
    shown.finish(text)
    return text


class Shown:
    """The sampled text given to `stream` as it grows: the prompt first, then each new token's
    text once it decodes whole (a character split over byte-level tokens waits for its last
    byte, as `tokenizers`' DecodeStream buffers it), nothing after the separator `eot` (None:
    it is text like any other). `prompt`: the whole prompt, shown first where `ids` lack its
    healed last token, whose text every first token allowed starts with."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        ids: list[int],
        eot: int | None,
        stream: Callable[[str], None] | None,
        prompt: str = "",
    ) -> None:
        self.tokenizer, self.eot, self.stream = tokenizer, eot, stream
        self.done, self.stopped = "", False
        self.decoder = DecodeStream(skip_special_tokens=False)
        self.decoded = "".join(self._decode(token) for token in ids)  # the text of ids so far
        # The prompt as one piece; one healed in the middle of a character shows it whole later.
        self._show(prompt or self.decoded)

    def add(self, next_id: torch.Tensor) -> None:
        token = int(next_id[0, 0])
        self.stopped |= token == self.eot
        if not self.stopped and self.stream is not None:
            self.decoded += self._decode(token)
            self._show(self.decoded)

    def finish(self, text: str) -> None:
        """The rest of the text returned, a split character's replacement included."""
        self._show(text)

    def _decode(self, token: int) -> str:
        return self.decoder.step(self.tokenizer, token) or ""  # None: a character's bytes so far

    def _show(self, text: str) -> None:
        if self.stream is not None and text.startswith(self.done) and len(text) > len(self.done):
            self.stream(text[len(self.done) :])
            self.done = text


def heal(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[int], torch.Tensor | None]:
    """Token healing: the prompt's ids without the last token, and a mask of the tokens
    whose text starts with that token's, among which the first one is sampled. A prompt that
    ends mid-token otherwise puts the model where training never was: "x = " ends in a lone
    space token, while the corpus holds " 1" or " None" as one token each. The output still
    starts with the whole prompt. A prompt of one token (nothing would be left) or ending in
    the separator is left as it is."""
    eot = tokenizer.token_to_id(EOT)
    if len(ids) < 2 or ids[-1] == eot:
        return ids, None
    stem = tokenizer.id_to_token(ids[-1])  # byte-level: a prefix of the text is one of the token
    allowed = torch.zeros(tokenizer.get_vocab_size(), dtype=torch.bool)
    vocab = tokenizer.get_vocab().items()
    allowed[[index for token, index in vocab if token.startswith(stem) and index != eot]] = True
    return ids[:-1], allowed


def logits_hook(
    vocab_limit: int, vocab_size: int, first_allowed: torch.Tensor | None = None
) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """generate()'s logits_hook: only the tokenizer's vocab_limit ids are drawn (the model's
    vocab_size may pad past them, and those rows decode to no text), cut before temperature,
    top_k and top_p so the probabilities are over the real vocabulary; and the first token only
    among the ids `first_allowed` marks (a bool mask over those ids: token healing, see `heal`)."""
    if not 0 < vocab_limit <= vocab_size:
        raise ValueError(f"vocab_limit={vocab_limit}: must be in 1..vocab_size ({vocab_size})")
    if first_allowed is not None and (
        first_allowed.shape != (vocab_limit,) or first_allowed.dtype != torch.bool
    ):
        raise ValueError(
            f"first_allowed: must be a bool mask of shape ({vocab_limit},), "
            f"not {first_allowed.dtype} {tuple(first_allowed.shape)}"
        )
    if first_allowed is not None and not bool(first_allowed.any()):
        raise ValueError("first_allowed: allows no token")

    def hook(step: int, logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, :vocab_limit]  # (B, vocab_limit)
        if step == 0 and first_allowed is not None:
            logits = logits.masked_fill(~first_allowed.to(logits.device), float("-inf"))
        return logits

    return hook


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--run", type=cli_path, required=True, help="run directory written by train.py"
    )
    parser.add_argument(
        "--prompt",
        default="\n",
        help='text to continue (default: a newline); "<|endoftext|>" starts a new document',
    )
    parser.add_argument(
        "--tokens", type=int, default=200, help="tokens to generate (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="0 is greedy; inf draws uniformly from the tokens --top-k/--top-p keep "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=50,
        help="sample from the k likeliest; 0 = all (default: %(default)s)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="then the fewest likeliest whose probabilities reach p (nucleus); 1 = all (default)",
    )
    parser.add_argument(
        "--stop-at-eot",
        action="store_true",
        help="end at the first sampled <|endoftext|>, the end of a document",
    )
    parser.add_argument(
        "--attention",
        choices=list(VARIANTS),
        metavar="VARIANT",
        help=f"attention variant to sample with (default: the run's): {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="precision to sample in (default: the run's train.dtype; auto: bf16 autocast on "
        "CUDA from Ampere on, fp32 elsewhere)",
    )
    parser.add_argument(
        "--no-token-healing",
        action="store_true",
        help="keep the prompt's last token; by default it is sampled again among the tokens "
        'that start with its text, so a prompt ending mid-token ("x = ") continues as text would',
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="of the sampling (default: %(default)s)"
    )
    parser.add_argument(
        "--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps"
    )
    return parser.parse_args(argv)


def args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags given, naming the flag, or None."""
    # Each flag's valid values (comparisons that NaN fails too) and what to say otherwise.
    problems = {
        "--tokens": (lambda v: v >= 0, "must be >= 0"),
        "--temperature": (lambda v: v >= 0, "must be >= 0 (0 is greedy)"),
        "--top-k": (lambda v: v >= 0, "must be >= 0 (0 samples from the whole vocabulary)"),
        "--top-p": (lambda v: 0 < v <= 1, "must be in (0, 1]; 1 keeps every token"),
        "--seed": (lambda v: -(2**63) <= v < 2**64, "must be in [-2**63, 2**64)"),  # torch's
    }
    for flag, (valid, problem) in problems.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if not valid(value):
            return f"{flag} {value}: {problem}"
    if not is_utf8(str(args.run)):  # the tokenizer library cannot open such a path
        return f"--run {str(args.run)!r}: not valid UTF-8; rename the folder"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (problem := args_problem(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    printed: list[str] = []  # the text so far, as it is sampled

    def stream(piece: str) -> None:
        printed.append(piece)
        say(piece, end="")

    try:
        sample_run(
            args.run,
            args.prompt,
            args.tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            top_p=args.top_p,
            seed=args.seed,
            device=args.device,
            device_setting="--device",
            stop_at_eot=args.stop_at_eot,
            attention=args.attention,
            dtype=args.dtype,
            token_healing=not args.no_token_healing,
            stream=stream,
        )
        say()
    except UnicodeEncodeError as e:  # the prompt is checked: this is stdout's encoding
        print(f"error: {cannot_show(e, 'the sampled text')}", file=sys.stderr)
        return 2
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StdoutClosed as e:
        return stdout_closed(e)
    except KeyboardInterrupt:
        if printed:
            with contextlib.suppress(StdoutClosed):  # the text's reader may be gone too
                say()
        print(
            f"interrupted before the sample was complete (--tokens {args.tokens})"
            + ("; above, the text sampled so far" if printed else ""),
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
