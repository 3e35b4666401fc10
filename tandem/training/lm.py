"""Train the demo target: a small Llama LM on the Python standard library's source.

``python -m tandem.training.lm --out DIR`` trains a byte-level BPE tokenizer on the stdlib (the
demo's), then a dense causal Llama (``dense_llama``) on the packed token stream, and writes a normal
HF ``LlamaForCausalLM`` folder (config, safetensors, tokenizer with chat template) that our engine
and transformers both load. Every ``LMTrainConfig.eval_every`` steps the loss on held-out stdlib files is shown;
``--resume`` continues a run from its last checkpoint. ``--preset gpu`` is the larger variant for
benchmarks (a GPU and minutes there, instead of a CPU and minutes here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.errors import ConfigError, TandemError
from tandem.training import corpus
from tandem.training.dense_llama import DenseLlama, LlamaDims, save_hf_folder
from tandem.training.optim import OptimConfig, make_optimizer, optimizer_step
from tandem.training.progress import Progress, note
from tandem.training.state import (STATE_FILE, flat_settings, has_state, load_state, resumed_settings_check,
                                   save_state, write_settings)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class LMTrainConfig:
    dims: LlamaDims = LlamaDims()
    steps: int = 1000
    batch_size: int = 8
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=100, weight_decay=0.1, grad_clip=1.0)
    corpus: corpus.CorpusConfig = corpus.CorpusConfig()
    seed: int = 0
    device: str = "cpu"
    precision: str = "auto"  # auto: bf16 autocast on GPUs and on CPUs with AMX, else float32
    compile: bool = True  # torch.compile the training step (about 2x on CPU); falls back to eager on failure
    eval_every: int = 250
    eval_windows: int = 48
    checkpoint_every: int = 250


PRESETS = {
    # ~4 M parameters, 2 M tokens (1.7 epochs of the corpus): about 3 minutes on 2 CPU cores (AMX
    # bf16, torch.compile); held-out loss ~3.5 nats/token, greedy continuations read as Python.
    "demo": LMTrainConfig(),
    # ~32 M parameters on all of Lib/ (~3 M tokens of Python 3.12's): a GPU run (~30 s on an H200), for
    # benchmarks on a real trained pair. 600 steps of 32 K tokens = ~6 epochs: many more steps overfit.
    "gpu": LMTrainConfig(
        dims=LlamaDims(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                       num_kv_heads=4, context=1024),
        steps=600, batch_size=32, device="cuda",
        optim=OptimConfig(lr=1.5e-3, warmup_steps=100, weight_decay=0.1, grad_clip=1.0),
        corpus=corpus.CorpusConfig(limit_bytes=64_000_000, recursive=True), eval_every=200, checkpoint_every=200),
}


def use_bf16(precision: str, device: torch.device) -> bool:
    if precision == "auto":
        if device.type == "cuda":
            return True
        amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        return bool(amx())  # without AMX, CPU bf16 matmuls are slower than float32 ones
    return precision == "bf16"


@torch.no_grad()
def heldout_loss(model: DenseLlama, windows: torch.Tensor, bf16: bool, batch: int = 16) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch].to(model.cos.device)
        with torch.autocast(chunk.device.type, dtype=torch.bfloat16, enabled=bf16):
            total += float(model.loss(chunk)) * len(chunk)
    model.train()
    return total / len(windows)


@torch.no_grad()
def greedy_continuation(model: DenseLlama, prompt: list[int], n: int) -> list[int]:
    model.eval()
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor([ids[-model.dims.context :]], device=model.cos.device)
        ids.append(int(model(x)[0, -1].argmax()))
    model.train()
    return ids[len(prompt) :]


def compiled_loss(model: DenseLlama, bf16: bool, device: torch.device):
    """The training loss under torch.compile: it fuses the many small element-wise ops (norms,
    rotary, SiLU) that dominate a model this small; the first step pays the compile (~10-60 s)."""

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return model.loss(batch)

    return torch.compile(loss_fn, dynamic=False)


def prepare_tokenizer(run_dir: Path, vocab_size: int) -> None:
    from tandem.training.stdlib_text import train_tokenizer

    if not all((run_dir / f).is_file() for f in TOKENIZER_FILES):
        note(f"training the BPE tokenizer (vocab {vocab_size}) on the stdlib source")
        train_tokenizer(run_dir, vocab_size)


def check_not_in_package(out_dir: Path) -> None:
    """A trainer's output never goes inside the installed package: its shipped demo pair (which ``tandem up`` serves by
    default) carries training.json files, which would otherwise pass for a run of this trainer and be replaced."""
    import tandem

    package = Path(tandem.__file__).resolve().parent
    out = out_dir.resolve()
    if out == package or package in out.parents:
        raise ConfigError(f"--out {out_dir}: lies inside the installed tandem package ({package}), whose demo pair it "
                          "would replace; give a folder of your own")


def check_out_dir(out_dir: Path) -> None:
    """``out_dir`` is replaced by the trained model, so it must be new, empty, or a model this trainer wrote (its
    training.json names the run's dims): any other folder or a file is refused, never deleted."""
    check_not_in_package(out_dir)
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: is a file, not a folder")
    if not any(out_dir.iterdir()):
        return
    try:
        written = "dims" in json.loads((out_dir / "training.json").read_text()).get("config", {})
    except (OSError, ValueError, AttributeError):
        written = False
    if not written:
        raise ConfigError(f"--out {out_dir}: holds files this trainer did not write (no training.json of a run): it "
                          "would be replaced; give a new or empty folder")


def train_lm(cfg: LMTrainConfig, out_dir: str | Path, run_dir: str | Path | None = None, resume: bool = False) -> dict:
    """Train and write the HF folder ``out_dir``; returns the summary also written to training.json."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise ConfigError(f"--steps and --batch-size must be at least 1, got {cfg.steps} and {cfg.batch_size}")
    if not (math.isfinite(cfg.optim.lr) and cfg.optim.lr > 0):
        raise ConfigError(f"--lr must be a positive number, got {cfg.optim.lr}")
    run_dir = Path(run_dir) if run_dir is not None else out_dir.with_name(out_dir.name + ".run")
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = flat_settings(dims=cfg.dims, batch_size=cfg.batch_size, seed=cfg.seed, optim=cfg.optim, corpus=cfg.corpus)
    resuming = resume and has_state(run_dir)
    if not resuming:  # a fresh run starts from nothing: a later --resume must not find an earlier run's checkpoint or
        for name in (STATE_FILE, *TOKENIZER_FILES):  # tokenizer
            (run_dir / name).unlink(missing_ok=True)
    if (new := resumed_settings_check(run_dir, settings, resuming)) is not None:  # (a run of an older version: its own)
        write_settings(run_dir, new)
    device = torch.device(cfg.device)
    bf16 = use_bf16(cfg.precision, device)
    prepare_tokenizer(run_dir, cfg.dims.vocab_size)
    tok = corpus.load_tokenizer(run_dir)
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    train_files, heldout_files = corpus.split_files(cfg.corpus)
    train = corpus.encode_stream(tok, train_files, bos, eos)
    heldout = corpus.eval_windows(corpus.encode_stream(tok, heldout_files, bos, eos), cfg.dims.context + 1, cfg.eval_windows)
    note(f"corpus: {len(train_files)} train files ({len(train):,} tokens), {len(heldout_files)} held-out files; "
         f"{'bf16 autocast' if bf16 else 'float32'} on {device}")

    torch.manual_seed(cfg.seed)
    model = DenseLlama(cfg.dims)
    model.init_weights(cfg.seed)
    model.to(device).train()
    opt = make_optimizer(model, cfg.optim)
    start = 0
    if resuming:
        start, _ = load_state(run_dir, model, opt)
        note(f"resumed from step {start} ({run_dir})")
    params = sum(p.numel() for p in model.parameters())
    note(f"model: {params / 1e6:.1f} M parameters, {cfg.steps} steps of {cfg.batch_size} x {cfg.dims.context} tokens")

    step_loss = compiled_loss(model, bf16, device) if cfg.compile else None
    bar = Progress("lm", cfg.steps, start)
    loss_ema, eval_loss, started = None, float("nan"), time.perf_counter()
    for step in range(start, cfg.steps):
        batch = corpus.train_windows(train, cfg.batch_size, cfg.dims.context + 1, cfg.seed, step).to(device)
        loss = None
        if step_loss is not None:
            try:
                loss = step_loss(batch)
            except Exception as e:  # no C++ compiler, unsupported op...: eager is slower, not wrong
                note(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); training eagerly")
                step_loss = None
        if loss is None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model.loss(batch)
        loss.backward()
        optimizer_step(model, opt, cfg.optim, step, cfg.steps)
        value = float(loss.detach())
        loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            eval_loss = heldout_loss(model, heldout, bf16)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            save_state(run_dir, model, opt, done)
        bar.update(done, cfg.batch_size * cfg.dims.context, force=done % cfg.eval_every == 0,
                   loss=loss_ema, heldout=eval_loss)
    bar.close()

    summary = {
        "train_loss_ema": loss_ema, "heldout_loss": heldout_loss(model, heldout, bf16), "steps": cfg.steps,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.dims.context, "train_tokens": len(train),
        "parameters": params, "precision": "bf16-autocast" if bf16 else "float32",
        "seconds_this_run": round(time.perf_counter() - started, 1),
        "heldout_files": [f.name for f in heldout_files],
    }
    write_model(model, out_dir, run_dir, bos, eos, summary, cfg)
    prompt = tok.encode("def read_config(path):\n", add_special_tokens=False).ids
    sample = tok.decode(greedy_continuation(model, prompt, 48))
    note(f"held-out loss {summary['heldout_loss']:.3f}; greedy sample:\n----\ndef read_config(path):\n{sample}\n----")
    return summary


def write_model(model: DenseLlama, out_dir: Path, run_dir: Path, bos: int, eos: int, summary: dict, cfg: LMTrainConfig) -> None:
    """Write the HF folder atomically (to a temporary sibling, then renamed)."""
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_folder(model, tmp, bos, eos, extra={"seed": cfg.seed, "steps": cfg.steps})
    for name in TOKENIZER_FILES:
        shutil.copy(run_dir / name, tmp / name)
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}) + "\n")
    (tmp / "training.json").write_text(json.dumps({"summary": summary, "config": dataclasses.asdict(cfg)}, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.training.lm", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output HF model folder")
    p.add_argument("--run-dir", default=None, help="checkpoints and tokenizer work folder (default: OUT.run)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: the preset's)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-compile", action="store_true", help="train eagerly (no torch.compile)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset]
    overrides = {k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size), ("device", args.device),
                                   ("precision", args.precision), ("seed", args.seed)) if v is not None}
    if args.lr is not None:
        overrides["optim"] = dataclasses.replace(cfg.optim, lr=args.lr)
    if args.no_compile:
        overrides["compile"] = False
    cfg = dataclasses.replace(cfg, **overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        train_lm(cfg, args.out, args.run_dir, resume=args.resume)
    except (TandemError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
