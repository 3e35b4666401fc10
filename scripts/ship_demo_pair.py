"""Write the demo pair that ships inside the package (tandem/demo_pair/) from a pair the project's own
recipe trained (``tandem demo-models --rebuild``, by default the cached one): its float tensors stored as
bfloat16 (half the bytes; the CPU engine computes in float32 all the same), everything else as is.

    python scripts/ship_demo_pair.py [--from ~/.cache/tandem/demo/v2-trained]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHIPPED = Path(__file__).resolve().parent.parent / "tandem" / "demo_pair"
FILES = {"target": ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "training.json"),
         "draft": ("config.json", "training.json")}


def ship(source: Path, dest: Path = SHIPPED) -> None:
    for kind, files in FILES.items():
        out = dest / kind
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for name in files:
            shutil.copyfile(source / kind / name, out / name)
        config = json.loads((out / "config.json").read_text())
        config["torch_dtype"] = "bfloat16"
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = load_file(str(source / kind / "model.safetensors"))
        save_file({k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    from tandem.training.demo import DEMO_VERSION
    from tandem.model_source import cache_root

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", default=str(cache_root() / "demo" / DEMO_VERSION))
    ship(Path(p.parse_args().source))
