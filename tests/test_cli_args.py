"""The shared flags (tandem/args.py): SGLang's and vLLM's spellings give the config our own spelling gives, in
every CLI that has the flag; EAGLE-1/2 and unknown speculative settings are refused by name; --help shows
every flag's default; tandem up passes the engine flags through and picks free internal ports."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from tandem import args as shared
from tandem import speculative_flags
from tandem import command_line
from tandem.cli import build_parser, generate_settings
from tandem.errors import ConfigError
from tandem.launcher import plan_up


@pytest.fixture
def folders(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    draft.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (target / "tokenizer.json").write_text("{}")  # the gateway only checks the folder here
    return str(target), str(draft)


def _verifier(argv):
    from verifier.__main__ import build_parser as verifier_parser
    from verifier.config import VerifierConfig

    args = verifier_parser().parse_args(argv)
    return VerifierConfig.from_args(args, args.model)


def _drafter(argv, target):
    from drafter.__main__ import build_parser as drafter_parser
    from drafter.config import DrafterServiceConfig

    args = drafter_parser().parse_args(argv)
    return DrafterServiceConfig.from_args(args, speculative_flags.resolve_speculative(args, target).draft_model, target)


def _generate(argv):
    args = build_parser().parse_args(["generate", "--prompt-token-ids", "1,2", "--max-new-tokens", "4", *argv])
    return generate_settings(args)


def _up(argv, secret="/tmp/secret"):
    args = build_parser().parse_args(["up", "--verifier-port", "1", "--drafter-port", "2", "--metrics-port", "3",
                                      "--drafter-metrics-port", "4", *argv])
    return plan_up(args, secret)


def _argvs(plan):
    return {c.name: c.argv for c in plan.children}


# ---- aliases ---------------------------------------------------------------------------------------


def test_verifier_aliases_give_the_canonical_config(folders):
    t, d = folders
    canonical = _verifier(["--model", t, "--tp-size", "2", "--draft-model", d, "--drafter", "in-process",
                           "--max-running-requests", "8", "--disable-cuda-graph"])
    for alias in (["--model-path", t, "--tensor-parallel-size", "2", "--speculative-draft-model-path", d,
                   "--drafter", "in-process", "--max-num-seqs", "8", "--enforce-eager"],
                  ["--model-path", t, "-tp", "2", "--draft-model", d, "--drafter", "in-process",
                   "--max-running-requests", "8", "--enforce-eager"]):
        assert _verifier(alias) == canonical


def test_sglangs_max_total_tokens_sizes_the_kv_pool_in_whole_pages(folders):
    t, _ = folders
    assert _verifier(["--model", t, "--max-total-tokens", "1000"]) == _verifier(["--model", t, "--kv-pages", "63"])
    assert _verifier(["--model", t, "--max-total-tokens", "64K", "--page-size", "64"]) == \
        _verifier(["--model", t, "--kv-pages", "1024", "--page-size", "64"])
    assert "--max-total-tokens" in _argvs(_up(["--model", t, "--max-total-tokens", "4096", "--draft-model", "none"]))[
        "verifier"]
    with pytest.raises(ConfigError, match="give one"):
        _verifier(["--model", t, "--max-total-tokens", "1000", "--kv-pages", "9"])


def test_a_draft_shape_without_a_draft_is_named_as_ignored(folders, caplog):
    """Target-only with --speculative-num-draft-tokens started silently (with a draft the same value is checked)."""
    import logging

    t, _ = folders
    with caplog.at_level(logging.WARNING, logger="tandem"):
        _up(["--model", t, "--draft-model", "none", "--speculative-num-draft-tokens", "6"])
        _verifier(["--model", t, "--speculative-eagle-topk", "2", "--speculative-num-steps", "2"])
    assert [r.getMessage() for r in caplog.records] == [
        "--speculative-num-draft-tokens shapes the draft, but there is no draft model: ignored (speculation is off)",
        "--speculative-num-steps and --speculative-eagle-topk shape the draft, but there is no draft model: ignored "
        "(speculation is off)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tandem"):
        _verifier(["--model", t])
    assert not caplog.records


def test_draft_model_none_is_target_only_in_the_verifier_as_in_tandem_up(folders):
    t, _ = folders
    assert _verifier(["--model", t, "--draft-model", "none"]) == _verifier(["--model", t])
    assert _verifier(["--model", t, "--draft-model", "none"]).draft_model is None


def test_speculative_algorithm_eagle3_runs_the_head_in_process(folders):
    t, d = folders
    sglang = _verifier(["--model-path", t, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", d,
                        "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                        "--speculative-num-draft-tokens", "6"])
    ours = _verifier(["--model", t, "--drafter", "in-process", "--draft-model", d, "--speculative-num-steps", "5"])
    assert sglang == ours
    assert (ours.drafter, ours.num_steps, ours.topk, ours.num_draft_tokens) == ("in-process", 5, 1, 6)
    # lower case too, as SGLang's users type it
    assert _verifier(["--model", t, "--speculative-algorithm", "eagle3", "--draft-model", d]).drafter == "in-process"
    # a draft named alone speculates too (the head in this process), as the flag's help says; none: target-only
    assert _verifier(["--model", t, "--draft-model", d]).drafter == "in-process"
    assert _verifier(["--model", t]).drafter is None


def test_vllm_engine_flag_spellings(folders):
    t, _ = folders
    vllm = _verifier(["--model", t, "--max-model-len", "64", "--gpu-memory-utilization", "0.5", "--block-size", "8",
                      "--max-num-batched-tokens", "512"])
    ours = _verifier(["--model", t, "--context-length", "64", "--mem-fraction-static", "0.5", "--page-size", "8",
                      "--chunked-prefill-size", "512"])
    assert vllm == ours and (ours.engine.context_length, ours.engine.mem_fraction_static, ours.engine.page_size) == (64, 0.5, 8)
    assert ours.engine.chunked_prefill_size == 512


def test_more_sglang_and_vllm_engine_spellings(folders):
    """The spellings of SGLang's and vLLM's command lines give the config ours gives, in the verifier and in
    tandem generate; switches asking for what Tandem does anyway are taken and change nothing."""
    t, _ = folders
    theirs = ["--model", t, "--tp", "1", "--dtype", "half", "--max-model-len", "32K", "--disable-radix-cache",
              "--random-seed", "7", "--attention-backend", "torch_native", "--enable-chunked-prefill",
              "--trust-remote-code"]
    ours = ["--model", t, "--tp-size", "1", "--dtype", "float16", "--context-length", "32768",
            "--disable-prefix-caching", "--seed", "7", "--attention-backend", "torch"]
    assert _verifier(theirs).engine == _verifier(ours).engine
    engine = _verifier(ours).engine
    assert (engine.dtype, engine.context_length, engine.enable_prefix_caching, engine.seed, engine.attention_backend) == \
        ("float16", 32768, False, 7, "torch")
    assert _generate(theirs)[0] == _generate(ours)[0] == engine
    assert _verifier(["--model", t, "--no-enable-prefix-caching"]).engine.enable_prefix_caching is False
    assert _verifier(["--model", t, "--enable-prefix-caching"]).engine == _verifier(["--model", t]).engine
    assert _verifier(["--model", t, "--dtype", "bf16"]).engine.dtype == "bfloat16"
    for given, tokens in (("32k", 32000), ("25.6k", 25600), ("1M", 1 << 20), ("4096", 4096)):  # vLLM's rule
        assert _verifier(["--model", t, "--max-model-len", given]).engine.context_length == tokens, given
    for bad in (["--max-model-len", "32q"], ["--max-model-len", "2.5K"], ["--attention-backend", "fa3"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            _verifier(["--model", t, *bad])


def test_quantization_flags_name_what_the_checkpoint_holds(folders, tmp_path):
    """vLLM's and SGLang's --quantization is checked against the checkpoint's quantization_config (what Tandem
    loads); --kv-cache-dtype takes auto only (the KV cache keeps the model's dtype)."""
    t, _ = folders
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({"hidden_size": 64, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    parse = lambda argv: build_parser().parse_args(["generate", "--prompt-token-ids", "1", "--max-new-tokens", "1",  # noqa: E731
                                                    *argv])
    assert shared.resolve_target(parse(["--model", str(fp8), "--quantization", "fp8"])) == str(fp8)
    assert shared.resolve_target(parse(["--model", t, "-q", "none"])) == t
    for folder, asked, held in ((t, "fp8", "none"), (str(fp8), "awq", "fp8"), (str(fp8), "compressed_tensors", "fp8")):
        with pytest.raises(ConfigError, match=f"--quantization {asked}: the checkpoint's quantization_config says {held}"):
            shared.resolve_target(parse(["--model", folder, "--quantization", asked]))
    assert _verifier(["--model", t, "--kv-cache-dtype", "auto"]).engine == _verifier(["--model", t]).engine
    with pytest.raises(SystemExit):
        _verifier(["--model", t, "--kv-cache-dtype", "fp8_e4m3"])


def test_tool_and_reasoning_parser_flags_reach_the_gateway_as_vllm_and_sglang_name_them(capsys):
    """tandem up passes --tool-call-parser, --enable-auto-tool-choice and --reasoning-parser to its gateway, which
    takes their names (an unknown one is refused listing the known); --enable-auto-tool-choice alone is refused, as
    vLLM refuses it."""
    from gateway.config import build_parser as gateway_parser, config_from_args
    from tandem.launcher import _passthrough

    argv = ["--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1"]
    up = build_parser().parse_args(["up", *argv])
    assert _passthrough(up, shared.GATEWAY_FLAGS) == argv
    gateway = gateway_parser().parse_args(["--verifier", "x:1", "--model", "m", *argv])
    assert (gateway.tool_call_parser, gateway.reasoning_parser) == ("kimi_k2", "deepseek_r1")
    with pytest.raises(SystemExit):
        gateway_parser().parse_args(["--verifier", "x:1", "--model", "m", "--tool-call-parser", "llama4_pythonic"])
    assert "kimi_k2" in capsys.readouterr().err
    alone = gateway_parser().parse_args(["--verifier", "x:1", "--model", "m", "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        config_from_args(alone)


@pytest.mark.parametrize("argv", [["--enable-expert-parallel"], ["--enable-ep-moe"], ["--ep-size", "8"],
                                  ["--expert-parallel-size", "8"]])
def test_expert_parallel_flags_are_refused_saying_why(argv, capsys):
    from verifier.__main__ import build_parser as verifier_parser

    for parse in (lambda: build_parser().parse_args(["up", *argv]),
                  lambda: verifier_parser().parse_args(["--model", "m", *argv])):
        with pytest.raises(SystemExit):
            parse()
        assert f"{argv[0]}: expert parallelism is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--dp", "2"], "data parallelism is not built in"), (["--data-parallel-size", "4"], "data parallelism is not"),
    (["--enable-dp-attention"], "data-parallel attention is not supported"), (["--nnodes", "2"], "one host only"),
    (["--dist-init-addr", "10.0.0.1:5000"], "one host only"), (["--pp-size", "2"], "pipeline parallelism is not"),
    (["--moe-runner-backend", "triton"], "its own fused MoE kernels"), (["--enable-eplb"], "its own fused MoE"),
    (["--node-rank", "1"], "one host only"),
    (["--cuda-graph-bs", "1", "2", "4"], "the graphs' batch sizes are 1 to 8"),
    (["--kv-cache-dtype", "fp8_e5m2"], "give auto; quantized KV caches are not supported"),
])
def test_deployment_flags_of_sglang_and_vllm_are_refused_saying_why(argv, says, capsys):
    """A DeepSeek deployment's command line: each layout flag Tandem does not have is refused with its reason, from
    tandem up and the verifier, not "unrecognized arguments" (or a value taken for the model)."""
    from verifier.__main__ import build_parser as verifier_parser

    for parse in (lambda: build_parser().parse_args(["up", *argv]),
                  lambda: verifier_parser().parse_args(["--model", "m", *argv])):
        with pytest.raises(SystemExit):
            parse()
        err = capsys.readouterr().err
        assert f"{argv[0]}: " in err and says in err, err


def test_vllms_api_server_count_is_refused_past_one_saying_why(capsys):
    """vLLM's --api-server-count: one gateway process a stack, said by tandem up and the gateway; 1 is taken."""
    from gateway.config import build_parser as gateway_parser

    for parse in (lambda argv: build_parser().parse_args(["up", *argv]),
                  lambda argv: gateway_parser().parse_args(["--verifier", "v:1", "--model-dir", "m", *argv])):
        parse(["--api-server-count", "1"])
        with pytest.raises(SystemExit):
            parse(["--api-server-count", "4"])
        assert "--api-server-count: one gateway process a stack serves the API" in capsys.readouterr().err


def test_tokenizer_naming_the_model_folder_is_taken_another_refused(folders, tmp_path):
    from tandem.errors import ConfigError

    t, _ = folders
    plain = _verifier(["--model", t])
    assert _verifier(["--model", t, "--tokenizer", t]) == plain
    assert _verifier(["--model", t, "--tokenizer-path", t + "/"]) == plain
    from verifier.__main__ import build_parser as verifier_parser

    resolve = lambda argv: shared.resolve_target(verifier_parser().parse_args(argv))  # noqa: E731
    assert resolve(["--model", t, "--tokenizer", t + "/"]) == resolve(["--model", t])
    with pytest.raises(ConfigError, match=r"--tokenizer .*other: the tokenizer is the model folder's"):
        resolve(["--model", t, "--tokenizer", str(tmp_path / "other")])
    with pytest.raises(ConfigError, match="give --model"):
        _up(["--tokenizer", str(tmp_path / "other")])
    # checked by tandem up against the model as given; the verifier, handed the resolved folder, is not passed it
    assert "--tokenizer" not in _argvs(_up(["--model", t, "--tokenizer", t, "--draft-model", "none"]))["verifier"]


def test_the_peers_no_op_values_of_those_flags_are_taken(folders):
    t, _ = folders
    plain = _verifier(["--model", t])
    assert _verifier(["--model", t, "--ep-size", "1", "--dp", "1", "--nnodes", "1", "--pp-size", "1",
                      "--enable-torch-compile", "--kv-cache-dtype", "auto", "--node-rank", "0",
                      "--moe-runner-backend", "auto"]) == plain
    assert _verifier(["--model", t, "--ep-size", "01", "--dp", "1.0", "--moe-runner-backend", "AUTO"]) == plain


def test_log_level_in_every_service_and_through_tandem_up(folders):
    from gateway.config import build_parser as gateway_parser

    t, d = folders
    argvs = _argvs(_up(["--model", t, "--draft-model", d, "--log-level", "DEBUG"]))
    for name in ("verifier", "drafter", "gateway"):
        words = argvs[name]
        assert words[words.index("--log-level") + 1] == "debug", name
    assert "--log-level" not in _argvs(_up(["--model", t, "--draft-model", d]))["verifier"]  # the default: not passed
    assert gateway_parser().parse_args(["--verifier", "x:1", "--model", t, "--uvicorn-log-level", "warning"]).log_level \
        == "warning"
    assert gateway_parser().parse_args(["--verifier", "x:1", "--model", t]).log_level == "info"


def test_up_takes_the_model_as_vllm_serve_does(folders, tmp_path):
    """`tandem up MODEL`, and a request may then name the model by that path (vLLM's and SGLang's default name)
    beside the folder's name; with --served-model-name, that name alone."""
    from gateway.config import build_parser as gateway_parser, config_from_args

    t, d = folders
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    assert _argvs(_up([t, "--draft-model", d])) == _argvs(_up(["--model", t, "--draft-model", d]))
    for argv, names in (([t], (Path(t).name, t)), ([t, "--served-model-name", "mine"], ("mine",)),
                        ([t, "--served-model-name", "mine", "org/also-mine"], ("mine", "org/also-mine"))):
        gateway = _argvs(_up([*argv, "--draft-model", d], secret=str(secret)))["gateway"]
        cfg = config_from_args(gateway_parser().parse_args(gateway[gateway.index("gateway") + 1:]))
        assert cfg.model_names == names if "--served-model-name" in argv else cfg.model_names[:2] == names, cfg.model_names
        assert cfg.model_name == names[0]
    with pytest.raises(Exception, match="two models"):
        _up([d, "--model", t])


def test_vllm_speculative_config_is_a_chain_of_n_steps(folders):
    t, d = folders
    config = json.dumps({"method": "eagle3", "model": d, "num_speculative_tokens": 5})
    vllm = _verifier(["--model", t, "--speculative-config", config, "--drafter", "127.0.0.1:1"])
    ours = _verifier(["--model", t, "--draft-model", d, "--speculative-num-steps", "5", "--speculative-eagle-topk",
                      "1", "--speculative-num-draft-tokens", "6", "--drafter", "127.0.0.1:1"])
    assert vllm == ours
    one_gpu = json.dumps({"method": "eagle3", "model": d, "num_speculative_tokens": 5, "draft_tensor_parallel_size": 1})
    assert _verifier(["--model", t, "--speculative-config", one_gpu, "--drafter", "127.0.0.1:1"]) == ours
    with pytest.raises(ConfigError, match="'draft_tensor_parallel_size' not supported"):
        _verifier(["--model", t, "--speculative-config", one_gpu.replace('size": 1', 'size": 2'), "--drafter", "x:1"])
    assert _drafter(["--speculative-config", config], t) == _drafter(
        ["--model", d, "--speculative-num-steps", "5", "--speculative-num-draft-tokens", "6"], t)
    assert _generate(["--model", t, "--speculative-config", config]) == _generate(
        ["--model", t, "--draft-model", d, "--speculative-num-steps", "5"])


def test_drafter_aliases(folders):
    t, d = folders
    canonical = _drafter(["--model", d, "--disable-cuda-graph"], t)
    assert _drafter(["--speculative-draft-model-path", d, "--enforce-eager"], t) == canonical
    assert _drafter(["--draft-model", d, "--disable-cuda-graph", "--speculative-algorithm", "EAGLE3"], t) == canonical


def test_the_drafter_captures_draft_graphs_for_every_shorter_chain(folders):
    """A verifier's measured policy may shorten the chain at batch: the drafter service has graphs for each."""
    from tandem.speculative.spec_config import SpecConfig

    t, d = folders
    specs = _drafter(["--model", d, "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                      "--speculative-num-draft-tokens", "4"], t).graph_specs
    assert specs == (SpecConfig(1, 1, 2), SpecConfig(2, 1, 3), SpecConfig(3, 1, 4))
    tree = _drafter(["--model", d, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                     "--speculative-num-draft-tokens", "6"], t).graph_specs
    assert tree == (SpecConfig(3, 2, 6),)


def test_the_drafter_takes_the_prefill_graph_flags_with_the_engines_defaults(folders):
    from tandem.engine.config import EngineConfig

    t, d = folders
    runtime = _drafter(["--model", d], t).runtime
    assert (runtime.prefill_graph_tokens, runtime.prefill_graph_max_bs) == (EngineConfig.prefill_graph_tokens,
                                                                            EngineConfig.prefill_graph_max_bs)
    runtime = _drafter(["--model", d, "--prefill-graph-tokens", "32", "--prefill-graph-max-bs", "2"], t).runtime
    assert (runtime.prefill_graph_tokens, runtime.prefill_graph_max_bs) == (32, 2)
    with pytest.raises(ConfigError, match="--prefill-graph-tokens"):
        _drafter(["--model", d, "--prefill-graph-tokens", "-1"], t)


def test_verbose_is_taken_before_or_after_generate():
    from tandem import command_line

    tail = ["--max-new-tokens", "1", "--prompt", "x"]
    said = [command_line.parse_args(build_parser(), argv, subcommand=True).verbose
            for argv in (["generate", *tail], ["-v", "generate", *tail], ["generate", "-v", *tail])]
    assert said == [False, True, True]


def test_generate_aliases(folders):
    t, d = folders
    canonical = _generate(["--model", t, "--tp-size", "2", "--draft-model", d, "--max-running-requests", "3",
                           "--disable-cuda-graph"])
    assert _generate(["--model-path", t, "-tp", "2", "--speculative-draft-model-path", d, "--max-num-seqs", "3",
                      "--enforce-eager", "--speculative-algorithm", "EAGLE3"]) == canonical
    assert _generate(["--model-path", t, "--tensor-parallel-size", "2", "--speculative-draft-model-path", d,
                      "--max-num-seqs", "3", "--enforce-eager"]) == canonical
    engine, spec = canonical
    assert (engine.tp_size, engine.max_running_requests, engine.disable_cuda_graph) == (2, 3, True)
    assert (spec.draft_model, spec.num_steps, spec.topk, spec.num_draft_tokens) == (d, 3, 1, 4)


def test_up_aliases_give_the_same_command_lines(folders):
    t, d = folders
    canonical = _argvs(_up(["--model", t, "--tp-size", "2", "--draft-model", d, "--speculative-num-steps", "4",
                            "--speculative-num-draft-tokens", "5"]))
    for alias in (["--model-path", t, "-tp", "2", "--speculative-algorithm", "EAGLE3",
                   "--speculative-draft-model-path", d, "--speculative-num-steps", "4"],
                  ["--model-path", t, "--tensor-parallel-size", "2", "--speculative-config",
                   json.dumps({"method": "eagle3", "model": d, "num_speculative_tokens": 4})]):
        assert _argvs(_up(alias)) == canonical


def test_gateway_model_aliases(folders):
    from gateway.config import build_parser as gateway_parser, config_from_args

    t, _ = folders
    configs = [config_from_args(gateway_parser().parse_args(["--verifier", "127.0.0.1:1", flag, t]))
               for flag in ("--model-dir", "--model", "--model-path")]
    assert configs[0] == configs[1] == configs[2]


# ---- refusals --------------------------------------------------------------------------------------


def _refused(argv) -> str:
    with pytest.raises(ConfigError) as e:
        _verifier(argv)
    assert "\n" not in str(e.value)  # one line
    return str(e.value)


def test_eagle_1_2_is_refused_naming_both_widths(folders):
    t, d = folders
    message = _refused(["--model", t, "--speculative-algorithm", "EAGLE", "--draft-model", d])
    assert "EAGLE-1/2" in message and "EAGLE3" in message and "64 wide" in message and "192 wide" in message
    message = _refused(["--model", t, "--speculative-config", json.dumps({"method": "eagle", "model": d})])
    assert "EAGLE-1/2" in message and "method" in message
    with pytest.raises(ConfigError, match="EAGLE-1/2"):  # without a target to read: the widths by name
        _up(["--model", "/nowhere", "--speculative-algorithm", "EAGLE", "--draft-model", d])
    with pytest.raises(ConfigError, match="EAGLE-1/2"):  # tandem up's demo pair: its draft comes unnamed
        _up(["--speculative-algorithm", "EAGLE"])


@pytest.mark.parametrize("algorithm", ["EAGLE", "NEXTN"])
def test_sglangs_mtp_line_without_a_draft_is_refused_saying_the_mtp_layer_is_not_served(folders, algorithm):
    t, _ = folders
    message = _refused(["--model", t, "--speculative-algorithm", algorithm])
    assert "without a draft: the model's own MTP layer" in message and "EAGLE3" in message, message


def test_other_algorithms_unknown_keys_and_mixed_spellings_are_refused(folders):
    t, d = folders
    assert "'NGRAM' is not supported" in _refused(["--model", t, "--speculative-algorithm", "NGRAM"])
    assert "'medusa'" in _refused(["--model", t, "--speculative-config", '{"method": "medusa"}'])
    message = _refused(["--model", t, "--speculative-config",
                        json.dumps({"method": "eagle3", "model": d, "draft_tensor_parallel_size": 2, "x": 2})])
    assert "'draft_tensor_parallel_size', 'x' not supported" in message
    assert "not valid JSON" in _refused(["--model", t, "--speculative-config", "{method: eagle3}"])
    assert "JSON object" in _refused(["--model", t, "--speculative-config", "[1]"])
    zero = '{"method": "eagle3", "num_speculative_tokens": 0}'
    assert ">= 1" in _refused(["--model", t, "--speculative-config", zero])
    message = _refused(["--model", t, "--draft-model", d, "--speculative-config", '{"method": "eagle3"}'])
    assert "--speculative-config and --speculative-draft-model-path" in message
    assert "--speculative-draft-model-path" in _refused(["--model", t, "--speculative-algorithm", "EAGLE3"])


# ---- --help ----------------------------------------------------------------------------------------


def _parsers():
    from drafter.__main__ import build_parser as drafter_parser
    from gateway.config import build_parser as gateway_parser
    from verifier.__main__ import build_parser as verifier_parser

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {"tandem up": subs["up"], "tandem generate": subs["generate"], "tandem train-drafter": subs["train-drafter"],
            "verifier": verifier_parser(),
            "drafter": drafter_parser(), "gateway": gateway_parser()}


def test_every_flag_has_help_and_help_shows_defaults():
    for name, parser in _parsers().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings} has no help"
            shown = formatter._get_help_string(action)
            if not any(action.default is v for v in (None, False, argparse.SUPPRESS)):  # (0 is a default to show)
                assert "(default" in shown or "default:" in shown, \
                    f"{name} {action.option_strings}: --help does not show its default"
        assert "(default: 1)" in parser.format_help() or name == "gateway"


def test_device_auto_picks_cuda_when_torch_sees_a_gpu(monkeypatch, caplog):
    import torch

    caplog.set_level(logging.INFO, logger="tandem")
    assert shared.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert shared.resolve_device("auto") == "cuda"
    assert "--device auto: cuda (torch sees 2 GPU(s))" in caplog.text
    assert shared.resolve_device("cpu") == "cpu" and shared.resolve_device("cuda:1") == "cuda:1"
    for parser in _parsers().values():
        device = next((a for a in parser._actions if a.dest == "device"), None)
        assert device is None or device.default == "auto"


# ---- tandem up -------------------------------------------------------------------------------------


def test_up_passes_engine_flags_through_in_the_services_own_spelling(folders):
    from drafter.__main__ import build_parser as drafter_parser
    from gateway.config import build_parser as gateway_parser
    from verifier.__main__ import build_parser as verifier_parser

    t, d = folders
    argvs = _argvs(_up(["--model", t, "--draft-model", d, "--mem-fraction-static", "0.7", "--dtype", "bfloat16",
                        "--enforce-eager", "--cuda-graph-max-bs", "8", "--kv-pages", "100", "--max-num-seqs", "4",
                        "--prefill-graph-tokens", "64", "--speculation-policy", "always", "--decode-steps", "2", "--log-stats-interval", "5",
                        "--enable-log-requests", "--log-requests-level", "2", "--max-concurrent-requests", "9",
                        "--generation-config", "vllm", "--max-tokens-limit", "99", "--drafter-metrics-port", "7",
                        "--max-connections-per-address", "12"]))
    parsers = {"drafter": drafter_parser(), "verifier": verifier_parser(), "gateway": gateway_parser()}
    parsed = {name: parsers[name].parse_args(argv[3:]) for name, argv in argvs.items()}  # after "python -m NAME"
    v = parsed["verifier"]
    assert (v.mem_fraction_static, v.dtype, v.disable_cuda_graph, v.cuda_graph_max_bs, v.kv_pages,
            v.max_running_requests, v.speculation_policy, v.decode_steps, v.log_stats_interval) == \
        (0.7, "bfloat16", True, 8, 100, 4, "always", 2, 5.0)
    assert v.drafter == "127.0.0.1:2" and v.draft_model == d and v.metrics_port == 3
    assert (v.prefill_graph_tokens, v.prefill_graph_max_bs) == (64, 8)
    dr = parsed["drafter"]
    assert (dr.dtype, dr.disable_cuda_graph, dr.cuda_graph_max_bs, dr.port) == ("bfloat16", True, 8, 2)
    assert (dr.prefill_graph_tokens, dr.prefill_graph_max_bs) == (64, 8)  # its prompt-extend graphs' widths
    assert "--enforce-eager" not in argvs["verifier"] and "--disable-cuda-graph" in argvs["verifier"]
    g = parsed["gateway"]
    assert g.verifier == "127.0.0.1:1"
    assert (g.log_requests, g.log_requests_level, g.max_concurrent_requests, g.generation_config,
            g.max_tokens_limit, g.max_body_bytes, g.max_connections_per_address) == (True, 2, 9, "vllm", 99, 4 << 20, 12)
    assert dr.metrics_port == 7


def test_up_passes_any_other_service_flag_through(folders):
    from drafter.__main__ import build_parser as drafter_parser
    from gateway.config import build_parser as gateway_parser
    from verifier.__main__ import build_parser as verifier_parser

    t, d = folders
    argvs = _argvs(_up(["--model", t, "--draft-model", d, "--verifier-args", "--max-waiting-requests 7 --ring-rows 4096",
                        "--drafter-args", "--max-topk 4", "--gateway-args", "--log-level debug"]))
    v = verifier_parser().parse_args(argvs["verifier"][3:])
    assert (v.max_waiting_requests, v.ring_rows) == (7, 4096)
    assert drafter_parser().parse_args(argvs["drafter"][3:]).max_topk == 4
    assert gateway_parser().parse_args(argvs["gateway"][3:]).log_level == "debug"


def test_up_refuses_pass_through_flags_that_set_its_own_wiring(folders, tmp_path):
    """A gateway given another --port through --gateway-args served there while tandem up waited on its own port for
    600 s; every flag the launcher wires (each one a real flag of its service) is refused, abbreviations too."""
    from drafter.__main__ import build_parser as drafter_parser
    from gateway.config import build_parser as gateway_parser
    from tandem.up_passthrough import OWNED
    from verifier.__main__ import build_parser as verifier_parser

    t, d = folders
    parsers = {"drafter": drafter_parser(), "verifier": verifier_parser(), "gateway": gateway_parser()}
    for service, owned in OWNED.items():
        known = set(parsers[service]._option_string_actions)
        for flag, ours in owned.items():
            assert flag in known, (service, flag)
            shortest = next(flag[:n] for n in range(3, len(flag) + 1)  # (the shortest argparse takes for it)
                            if [o for o in known if o.startswith(flag[:n])] in ([flag], [])
                            or flag[:n] == flag)
            for word in (f"{flag} 1", f"{flag}=1", f"{flag[:-1]} 1", f"{shortest} 1", f"{flag[:3]} 1"):
                with pytest.raises(ConfigError) as refused:
                    _up(["--model", t, "--draft-model", d, f"--{service}-args={word}"])
                said, given = str(refused.value), word.split()[0].split("=")[0]
                assert said.startswith(f"--{service}-args: {given} is set by tandem up"), said
                named = [o for o in owned if o == given] or [o for o in owned if o.startswith(given)]
                if len({owned[o] for o in named}) == 1:  # (an abbreviation of several: argparse refuses it anyway)
                    assert ours is None or said.endswith(f": give tandem up {ours}"), said
    for service, parser in parsers.items():  # every flag of a service that tandem up does not wire passes
        for flag in parser._option_string_actions:
            if flag.startswith("--") and flag not in OWNED[service] and flag not in ("--help", "--config"):
                assert not [o for o in OWNED[service] if o.startswith(flag)], (service, flag)
    config = tmp_path / "verifier.yaml"
    config.write_text("max-waiting-requests: 7\nport: 9000\n")  # (its flags count as the command line's)
    with pytest.raises(ConfigError, match="^--verifier-args: --port is set by tandem up: give tandem up --verifier-port"):
        _up(["--model", t, "--draft-model", d, f"--verifier-args=--config {config}"])
    with pytest.raises(ConfigError, match="^--verifier-args: no closing quotation in "):
        _up(["--model", t, "--draft-model", d, "--verifier-args=--served-model-name 'x"])
    _up(["--model", t, "--draft-model", d, "--gateway-args=--metrics-prefix vllm",
         "--verifier-args=--drafter-deadline-ms 3000"])  # (flags beside them pass)


def test_up_drafter_in_process_starts_no_drafter(folders):
    t, d = folders
    argvs = _argvs(_up(["--model", t, "--draft-model", d, "--drafter", "in-process", "--spec-rounds", "2"]))
    assert set(argvs) == {"verifier", "gateway"}
    v = argvs["verifier"]
    assert v[v.index("--drafter") + 1] == "in-process"
    for service in ("verifier", "gateway"):  # the verifier requires it of its gateway
        assert argvs[service][argvs[service].index("--internal-secret-file") + 1] == "/tmp/secret"
    assert v[v.index("--spec-rounds") + 1] == "2"
    with pytest.raises(Exception, match="--reload-root"):
        _up(["--model", t, "--draft-model", d, "--drafter", "in-process", "--reload-root", "/x"])
    with pytest.raises(Exception, match="--draft-model"):
        _up(["--model", t, "--drafter", "in-process"])


def test_up_picks_free_internal_ports_and_keeps_the_public_defaults(folders):
    t, d = folders
    argv = ["up", "--model", t, "--draft-model", d]
    first, second = (plan_up(build_parser().parse_args(argv), "/tmp/s") for _ in range(2))
    for plan in (first, second):
        assert len(set(plan.ports.values())) == 4 and not set(plan.ports.values()) & {50051, 50052, 50053}
        gateway, drafter = plan.children[-1].argv, plan.children[0].argv
        # the drafter's metrics on a port of its own, relayed by the gateway's /metrics with the verifier's
        assert drafter[drafter.index("--metrics-port") + 1] == str(plan.ports["drafter_metrics"])
        assert gateway[gateway.index("--drafter-metrics-url") + 1] == \
            f"http://127.0.0.1:{plan.ports['drafter_metrics']}/metrics"
        assert gateway[gateway.index("--port") + 1] == "8000" and gateway[gateway.index("--grpc-port") + 1] == "50050"
        assert gateway[gateway.index("--verifier") + 1] == f"127.0.0.1:{plan.ports['verifier']}"
    assert first.ports != second.ports  # two stacks on one host
    given = plan_up(build_parser().parse_args(argv + ["--verifier-port", "6000"]), "/tmp/s")
    assert given.ports["verifier"] == 6000


@pytest.mark.parametrize("ports, says", [
    (["--port", "8011", "--grpc-port", "8011"], "--port and --grpc-port are both 8011"),
    (["--port", "8011", "--verifier-port", "8011"], "--port and --verifier-port are both 8011"),
    (["--metrics-port", "7001", "--drafter-metrics-port", "7001"], "--metrics-port and --drafter-metrics-port are both"),
])
def test_up_refuses_one_port_for_two_services_before_anything_starts(folders, ports, says):
    """The same port twice: the gateway failed on itself after the models loaded, or (--verifier-port = --port) the
    launcher's HTTP health check read the verifier's gRPC and died with http.client.BadStatusLine."""
    from tandem.errors import TandemError

    t, d = folders
    with pytest.raises(TandemError, match=says):
        plan_up(build_parser().parse_args(["up", "--model", t, "--draft-model", d, *ports]), "/tmp/s")
    # the drafter's ports are its service's: with the head in the verifier they are unused
    plan_up(build_parser().parse_args(["up", "--model", t, "--draft-model", d, "--drafter", "in-process",
                                       "--drafter-port", "8000"]), "/tmp/s")


def test_stats_line_interval_flags(folders):
    t, _ = folders
    assert _verifier(["--model", t]).log_stats_interval_s == 10.0
    assert _verifier(["--model", t, "--log-stats-interval", "2.5"]).log_stats_interval_s == 2.5
    assert _verifier(["--model", t, "--disable-log-stats"]).log_stats_interval_s == 0.0
    assert ">= 0" in _refused(["--model", t, "--log-stats-interval", "-1"])


def test_a_config_file_gives_flags_and_the_command_line_wins(folders, tmp_path):
    """vLLM's --config: a YAML (or JSON) file of flag names and values, for every command; explicit flags win
    wherever they stand, a file that is not a mapping or names another config is refused."""
    t, d = folders
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {t}\ndraft_model: {d}\nspeculative-num-steps: 5\nenforce-eager: true\n"
                      f"max-num-seqs: 8\nspeculative_config: null\n")
    from verifier.__main__ import build_parser as verifier_parser

    v = _verifier_config(command_line.parse_args(verifier_parser(), ["--config", str(config), "--max-num-seqs", "4"]))
    assert (v.engine.model, v.draft_model, v.num_steps, v.engine.disable_cuda_graph, v.engine.max_running_requests) \
        == (t, d, 5, True, 4)
    v = _verifier_config(command_line.parse_args(verifier_parser(), ["--max-num-seqs", "4", "--config", str(config)]))
    assert v.engine.max_running_requests == 4  # the command line wins before the file's position too
    up = command_line.parse_args(build_parser(), ["up", "--config", str(config), "--port", "9000"], subcommand=True)
    assert (up.model, up.draft_model, up.speculative_num_steps, up.port) == (t, d, 5, 9000)
    as_json = tmp_path / "serve.json"
    as_json.write_text(json.dumps({"model": t, "speculative-config": {"method": "eagle3", "model": d,
                                                                        "num_speculative_tokens": 2}}))
    v = _verifier_config(command_line.parse_args(verifier_parser(), ["--config", str(as_json)]))
    assert (v.draft_model, v.num_steps, v.num_draft_tokens) == (d, 2, 3)
    # a false the flag's default would override goes as its --no- form (the engine process defaults on with a GPU)
    config.write_text(f"model: {t}\nengine-process: false\n")
    assert command_line.parse_args(verifier_parser(), ["--config", str(config)]).engine_process is False
    config.write_text(f"model: {t}\nengine_process: true\n")
    assert command_line.parse_args(verifier_parser(), ["--config", str(config)]).engine_process is True
    for bad in ("- just\n- a list\n", "config: other.yaml\n", "model: [unclosed\n"):
        config.write_text(bad)
        with pytest.raises(SystemExit):
            command_line.parse_args(verifier_parser(), ["--config", str(config)])


def test_a_config_value_of_the_wrong_shape_is_refused_by_its_key(folders, tmp_path, capsys):
    """A switch given other than true/false, a list for a flag of one value, one flag under two spellings: refused
    naming the key — as words, a switch's "yes" read as the model and a list's second value as another argument.
    A list for a repeatable flag repeats it."""
    t, _ = folders
    config = tmp_path / "serve.yaml"
    for text, said in ((f"model: {t}\ndisable-prefix-caching: 'yes'\n", 'disable-prefix-caching is a switch: true or '
                        'false, got "yes"'),
                       (f"model: {t}\nport: [1, 2]\n", "port takes one value, got a list [1, 2]"),
                       (f"model: {t}\nkv-pages: 10\nkv_pages: 20\n", "kv_pages and kv-pages are the same flag "
                        "(--kv-pages); give it once")):
        config.write_text(text)
        for argv, sub in ((["up", "--config", str(config)], True), (["generate", "--config", str(config)], True)):
            with pytest.raises(SystemExit):
                command_line.parse_args(build_parser(), argv, subcommand=sub)
            err = capsys.readouterr().err
            assert said in err and err.count("\n") == 1, err
    repeatable = argparse.ArgumentParser()
    repeatable.add_argument("--traffic", action="append")
    config.write_text("traffic: [/data/a, /data/b]\n")
    words = command_line.config_argv(str(config), arity=command_line._arity(repeatable))
    assert words == ["--traffic", "/data/a", "--traffic", "/data/b"]
    assert repeatable.parse_args(words).traffic == ["/data/a", "/data/b"]


def _verifier_config(args):
    from verifier.config import VerifierConfig

    return VerifierConfig.from_args(args, args.model)


def test_generate_refuses_more_new_tokens_than_the_context_holds(capsys):
    """As the gateway refuses it (400 / INVALID_ARGUMENT): not cut short to the context without a word."""
    from tandem.cli import main
    from tandem.training import demo

    target = str(demo.SHIPPED / "target")  # context 256
    assert main(["generate", "--model", target, "--prompt-token-ids", "5,6,7", "--max-new-tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max-new-tokens 100000: the prompt's 3 tokens") and "at most 253" in err, err
    assert main(["generate", "--model", target, "--prompt-token-ids", "5,6,7", "--max-new-tokens", "253",
                 "--temperature", "0", "--ignore-eos"]) == 0
    assert "[253 tokens" in capsys.readouterr().err


def test_generate_without_a_model_runs_the_demo_pair_as_tandem_up_serves_it(capsys):
    """README: without --model, tandem generate serves the demo pair — it ran the target alone (no draft)."""
    from tandem.cli import main

    argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos",
            "--json"]
    assert main(argv) == 0
    paired = json.loads(capsys.readouterr().out)
    assert main([*argv, "--draft-model", "none"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert paired["acceptance_by_position"] and not alone["acceptance_by_position"], (paired, alone)
    assert paired["output_token_ids"] == alone["output_token_ids"]  # (greedy: the same tokens either way)


def test_flags_for_a_service_pass_through_tandem_up_even_a_single_dashed_one(folders, tmp_path):
    """argparse takes a value that starts with a dash for an option: --verifier-args '--disable-log-stats' was refused
    (expected one argument); from a config file too."""
    t, _ = folders
    up = command_line.parse_args(build_parser(), ["up", "--model", t, "--verifier-args", "--disable-log-stats",
                                            "--gateway-args", "--max-tokens-limit 9"], subcommand=True)
    argvs = _argvs(plan_up(up, "/tmp/secret"))
    assert argvs["verifier"][-1] == "--disable-log-stats" and argvs["gateway"][-2:] == ["--max-tokens-limit", "9"]
    config = tmp_path / "up.yaml"
    config.write_text("verifier-args: --disable-log-stats\n")
    up = command_line.parse_args(build_parser(), ["up", "--model", t, "--config", str(config)], subcommand=True)
    assert up.verifier_args == "--disable-log-stats"
    with pytest.raises(SystemExit):
        command_line.parse_args(build_parser(), ["up", "--verifier-args"], subcommand=True)


def test_ports_out_of_range_and_empty_batches_are_refused_in_one_line(folders, capsys):
    """bind() took port 99999 as another port (the log then named that one); --max-num-seqs 0 started and failed
    every request in the engine loop."""
    t, _ = folders
    from gateway.config import build_parser as gateway_parser
    from verifier.__main__ import build_parser as verifier_parser

    for parser, argv in ((build_parser(), ["up", "--grpc-port", "99999"]),
                         (gateway_parser(), ["--verifier", "x:1", "--model-dir", t, "--port", "-1"]),
                         (verifier_parser(), ["--model", t, "--port", "65536"])):
        with pytest.raises(SystemExit):
            command_line.parse_args(parser, argv, subcommand=parser.prog == "tandem")
        assert "is not a port (0 to 65535)" in capsys.readouterr().err
    from tandem.training.cli import add_train_drafter

    trainer = command_line.ArgumentParser(prog="python -m drafter.train")
    add_train_drafter(trainer)
    for parser, argv in ((build_parser(), ["up", "--tp-size", "0"]), (build_parser(), ["generate", "--tp", "-2"]),
                         (verifier_parser(), ["--model", t, "--tensor-parallel-size", "0"]), (trainer, ["--tp", "0"])):
        with pytest.raises(SystemExit):  # (tandem up: before the drafter starts and the verifier refuses it)
            command_line.parse_args(parser, argv, subcommand=parser.prog == "tandem")
        assert "must be >= 1, got" in capsys.readouterr().err
    for flag, named in (("--max-num-seqs", r"--max-running-requests \(--max-num-seqs\)"), ("--kv-pages", "--kv-pages"),
                        ("--cuda-graph-max-bs", "--cuda-graph-max-bs")):
        with pytest.raises(ConfigError, match=f"{named} must be >= 1"):
            _verifier_config(command_line.parse_args(verifier_parser(), ["--model", t, flag, "0"]))
    with pytest.raises(SystemExit):
        command_line.parse_args(build_parser(), ["up", "--disable-log-stats"], subcommand=True)
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem up: error: unrecognized arguments: --disable-log-stats") and "--verifier-args" in err


def test_vllms_load_format_names(folders):
    t, _ = folders
    from verifier.__main__ import build_parser as verifier_parser

    for given, means in (("dummy", "random"), ("auto", "safetensors"), ("random", "random")):
        assert _verifier_config(command_line.parse_args(verifier_parser(), ["--model", t, "--load-format", given])) \
            .engine.load_format == means


def test_a_services_own_config_file_passes_through_not_taken_for_tandem_ups(folders, tmp_path):
    t, _ = folders
    mine = tmp_path / "verifier.yaml"
    mine.write_text("model: /elsewhere\n")
    up = command_line.parse_args(build_parser(), ["up", "--model", t, "--verifier-args", f"--config={mine}"], subcommand=True)
    assert up.model == t and up.verifier_args == f"--config={mine}"


@pytest.mark.parametrize("which, argv, abbreviated", [
    ("up", ["up", "--cuda-graph-m", "8"], "--cuda-graph-m"),
    ("verifier", ["--model", "m", "--cuda-graph-m", "8"], "--cuda-graph-m"),
    ("gateway", ["--verifier", "x:1", "--model", "m", "--max-body", "10"], "--max-body"),
    ("drafter", ["--model", "m", "--draft-model", "d", "--cuda-graph-m", "8"], "--cuda-graph-m"),
])
def test_a_flag_is_taken_only_spelled_whole(which, argv, abbreviated, capsys):
    """argparse takes the start of a flag for the flag it begins (``--cuda-graph-m 8`` was --cuda-graph-max-bs): a
    mistyped or shortened flag is refused, on every command line."""
    from drafter.__main__ import build_parser as drafter_parser
    from gateway.config import build_parser as gateway_parser
    from verifier.__main__ import build_parser as verifier_parser

    parser = {"up": build_parser, "verifier": verifier_parser, "gateway": gateway_parser,
              "drafter": drafter_parser}[which]()
    with pytest.raises(SystemExit):
        command_line.parse_args(parser, argv, subcommand=which == "up")
    assert f"unrecognized arguments: {abbreviated}" in capsys.readouterr().err
