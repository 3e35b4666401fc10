"""A request that reaches the end of the whole KV cache while speculating decodes plainly to it, as
target-only decoding does: same tokens, same finish, no preemption of itself over and over."""

from __future__ import annotations

from checkpoints import write_checkpoint
from proposers import RandomTreeProposer, Spec, always_speculate
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams


def test_speculation_stops_where_the_kv_cache_ends(tmp_path):
    path = tmp_path / "llama"
    write_checkpoint(path, "llama", seed=4, num_hidden_layers=2)
    cfg = EngineConfig(model=str(path), page_size=4, kv_pages=9)  # 8 usable pages (one is the dummy): 32 tokens
    prompt, params = list(range(3, 13)), SamplingParams(max_new_tokens=64, ignore_eos=True)
    with LLMEngine(cfg) as eng:
        expected = eng.generate([prompt], params)[0]
    capacity = 4 * (9 - 1)
    assert expected.finish_reason == "length" and len(prompt) + len(expected.output_token_ids) <= capacity + 1
    always = always_speculate()
    with LLMEngine(cfg, proposer=RandomTreeProposer(vocab=256, seed=1), spec=Spec(5), policy=always) as eng:
        rid = eng.add_request(prompt, params)
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        req = eng.requests.pop(rid)
    assert req.output == expected.output_token_ids and req.finish_reason.value == "length"
    assert req.num_preemptions == 0 and steps <= len(req.output) + 1
