"""The benchmark's sections by name (``bench.py --sections``). Each takes the shared context dict and
returns JSON-able results."""

from __future__ import annotations

from sections import ceilings, decode, spec, spec_goal
from sections_arrivals import arrivals
from sections_batch import batch
from sections_deepseek import deepseek
from sections_glue import round_glue
from sections_long_prompt import long_prompt
from sections_mla import mla
from sections_overlap import decode_overlap, overlap
from sections_prefix import prefix
from sections_profile import demo, phases
from sections_quant import quant_kernels
from sections_quant_engines import quant_engines
from sections_rest import rest, rest_demo
from sections_scaling import service, tp

SECTIONS = {"ceilings": ceilings, "decode": decode, "spec": spec, "spec_goal": spec_goal, "batch": batch, "rest": rest,
            "rest_demo": rest_demo, "arrivals": arrivals, "service": service, "tp": tp, "phases": phases, "demo": demo,
            "overlap": overlap, "decode_overlap": decode_overlap, "round_glue": round_glue,
            "quant_kernels": quant_kernels, "prefix": prefix, "long_prompt": long_prompt, "mla": mla,
            "deepseek": deepseek, "quant_engines": quant_engines}
