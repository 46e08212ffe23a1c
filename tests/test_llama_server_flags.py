"""llama-server's command lines as users copy them from its documentation and guides: each one is
read into the server's configuration (or refused in one line naming the flag), the LLAMA_ARG_*
variables with llama-server's names, exact option matching (no prefixes, no short-option
clustering), --help's defaults, and a few real starts with the tiny model.

Every "same" row of docs/server.md's flags table has a check here."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyllama.runtime.placement.devices import ALL_LAYERS, device_names, plan_devices
from pyllama.util.errors import PyllamaError
from pyllama.models.hparams import model_overrides
from pyllama.models.lora import lora_adapters
from pyllama.batching.sampling import SamplingParams
from pyllama.server import params
from pyllama.server.options import (UNSUPPORTED, build_parser, default_stop, log_level, parse_args, process_escapes,
                                    sampling_defaults, settings, spec_config)
from server_util import RPCServerProcess, ServerProcess, generated_tokens

LLAMA_VARS = ("LLAMA_ARG_", "PYLLAMA_ARG_", "LLAMA_API_KEY", "LLAMA_LOG_")
# every flag of llama-server's --help, one per line
LLAMA_SERVER_FLAGS = [ln.strip() for ln in (Path(__file__).parent / "data" / "llama_server_flags.txt")
                      .read_text(encoding="utf-8").splitlines() if ln.startswith("-")]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os
    for name in list(os.environ):
        if name.startswith(LLAMA_VARS):
            monkeypatch.delenv(name)


def refused(argv) -> str:
    with pytest.raises(PyllamaError) as info:
        parse_args(argv)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def exits(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


# --- real command lines -----------------------------------------------------------------------

def test_guide_command_line_gpu_server():
    a = parse_args("-m M -c 4096 -ngl 99 --host 0.0.0.0 --port 8080 -np 4 -cb -fa on --jinja".split())
    assert (a.model, a.ctx_size, a.n_gpu_layers, a.host, a.port, a.parallel) == ("M", 4096, 99, "0.0.0.0", 8080, 4)
    assert a.cont_batching is True and a.flash_attn == "on" and a.jinja is True
    assert a.n_predict == -1 and a.kv_unified is False  # -np given: split KV, as llama-server


def test_guide_command_line_api_key_metrics_slots():
    a = parse_args("-m M --api-key secret --metrics --slots".split())
    s = settings(a)
    assert s.api_keys == ["secret"] and s.metrics_enabled and s.slots_enabled and not s.props_writable


def test_guide_command_line_kv_types_and_threads():
    a = parse_args("-m M -ctk q8_0 -ctv q8_0 -t 2 -tb 2".split())
    assert (a.cache_type_k, a.cache_type_v, a.threads, a.threads_batch) == ("q8_0", "q8_0", 2, 2)


@pytest.mark.parametrize("line, check", [
    ("-m M --port 8080", lambda a: a.port == 8080 and a.host == "127.0.0.1"),
    ("-m M -c 2048 -n 256", lambda a: a.ctx_size == 2048 and a.n_predict == 256),
    ("-m M --predict 16", lambda a: a.n_predict == 16),
    ("-m M --n-predict 16", lambda a: a.n_predict == 16),
    ("-m M -a my-model", lambda a: a.alias == ["my-model"]),
    ("-m M --tags chat,small", lambda a: a.tags == ["chat", "small"]),
    ("-m M -fa --jinja", lambda a: a.flash_attn == "on" and a.jinja is True),
    ("-m M --alias gpt-4o,gpt-4o-mini", lambda a: settings(a).aliases == ["gpt-4o", "gpt-4o-mini"]),
    ("-m M -b 512 -ub 128", lambda a: (a.batch_size, a.ubatch_size) == (512, 128)),
    ("-m M --ctx-size 8192 --parallel 2", lambda a: (a.ctx_size, a.parallel) == (8192, 2)),
    ("-m M -np 8 -kvu", lambda a: a.parallel == 8 and a.kv_unified is True),
    ("-m M -np 8 --kv-unified", lambda a: a.kv_unified is True),
    ("-m M -no-kvu", lambda a: a.parallel == 4 and a.kv_unified is False),
    ("-m M -np -1", lambda a: a.parallel == 4 and a.kv_unified is True),
    ("-m M --no-cont-batching", lambda a: a.cont_batching is False),
    ("-m M -nocb", lambda a: a.cont_batching is False),
    ("-m M -fa", lambda a: a.flash_attn == "on"),
    ("-m M -fa off", lambda a: a.flash_attn == "off"),
    ("-m M --flash-attn auto", lambda a: a.flash_attn == "auto"),
    ("-m M --mlock --no-mmap", lambda a: a.mlock is True and a.mmap is False),
    ("-m M", lambda a: a.repack is True),
    ("-m M -nr", lambda a: a.repack is False),
    ("-m M --no-repack", lambda a: a.repack is False),
    ("-m M --no-repack --repack", lambda a: a.repack is True),
    ("-m M --reuse-port --offline", lambda a: a.reuse_port is True and a.offline is True),
    ("-m M --spm-infill", lambda a: a.spm_infill is True),
    ("-m M -nkvo --no-op-offload", lambda a: a.kv_offload is False and a.op_offload is False),
    ("-m M --kv-offload --op-offload", lambda a: a.kv_offload is True and a.op_offload is True),
    ("-m M -cram 0 --no-cache-idle-slots -ctxcp 8 --swa-checkpoints 4 -cms 0",
     lambda a: (a.cache_ram, a.cache_idle_slots, a.ctx_checkpoints, a.checkpoint_min_step) == (0, False, 4, 0)),
    ("-m M", lambda a: (a.cache_ram, a.cache_idle_slots) == (8192, True)),  # llama-server's defaults
    ("-m M -cram -1 --cache-idle-slots", lambda a: (a.cache_ram, a.cache_idle_slots) == (-1, True)),
    ("-m M -C 0x3 -Cr 4-5 --poll 50 -Cb 1 --poll-batch 0 --cpu-strict 0", lambda a: a.cpus == {0, 1, 4, 5}),
    ("-m M", lambda a: a.cpus is None),
    ("-m M --ui-config {\"theme\":\"dark\"}", lambda a: settings(a).ui_settings == {"theme": "dark"}),
    ("-m M --cors-methods GET,POST --cors-headers X-Api-Key,Content-Type --no-cors-credentials",
     lambda a: (settings(a).cors_methods, settings(a).cors_headers, settings(a).cors_credentials)
     == (["GET", "POST"], ["X-Api-Key", "Content-Type"], False)),
    ("-m M --numa distribute -cmoe -ncmoe 4",
     lambda a: (a.numa, a.cpu_moe, a.n_cpu_moe) == ("distribute", True, 4)),
    ("-m M --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768",
     lambda a: model_overrides(a) == {"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
                                      "{arch}.rope.scaling.original_context_length": 32768}),
    ("-m M --context-shift --keep 16", lambda a: a.context_shift is True and a.keep == 16),
    ("-m M --no-context-shift", lambda a: a.context_shift is False),
    ("-m M --timeout 30", lambda a: a.timeout == 30),
    ("-m M -to 45", lambda a: a.timeout == 45),
    ("-m M --threads-http 8", lambda a: a.threads_http == 8),
    ("-m M --no-slots", lambda a: settings(a).slots_enabled is False),
    ("-m M --props", lambda a: settings(a).props_writable is True),
    ("-m M -sps 0.5", lambda a: a.slot_prompt_similarity == 0.5),
    ("-m M --slot-prompt-similarity 0", lambda a: a.slot_prompt_similarity == 0.0),
    ("-m M --cache-reuse 256", lambda a: a.cache_reuse == 256),
    ("-m M --api-key k1,k2", lambda a: settings(a).api_keys == ["k1", "k2"]),
    ("-m M --cors-origins https://a.example,https://b.example",
     lambda a: settings(a).cors_origins == ["https://a.example", "https://b.example"]),
    ("-m M --no-webui", lambda a: a.webui is False),
    ("-m M --webui", lambda a: a.webui is True),
    ("-m M --no-jinja", lambda a: a.jinja is False),
    ("-m M --chat-template chatml", lambda a: a.chat_template == "chatml"),
    ("-m M --chat-template-kwargs {\"enable_thinking\":false}",
     lambda a: a.chat_template_kwargs == {"enable_thinking": False}),
    ("-m M --reasoning-format deepseek", lambda a: a.reasoning_format == "deepseek"),
    ("-m M --reasoning-format none", lambda a: a.reasoning_format == "none"),
    ("-m M --reasoning off --reasoning-budget 0", lambda a: a.reasoning == "off" and a.reasoning_budget == 0),
    ("-m M --sse-ping-interval 5", lambda a: a.sse_ping_interval == 5),
    ("-m M --skip-chat-parsing", lambda a: a.skip_chat_parsing is True),
    ("-m M --api-prefix /llama/v1x", lambda a: a.api_prefix == "/llama/v1x"),
    ("-m M --swa-full", lambda a: a.swa_full is True),
    ("-m M", lambda a: a.sse_ping_interval == 30 and a.reasoning_budget == -1 and a.reasoning == "auto"),
    ("-m M --temp 0.7 --top-k 20 --top-p 0.8 --min-p 0.01", lambda a: (a.temp, a.top_k, a.top_p, a.min_p) ==
     (0.7, 20, 0.8, 0.01)),
    ("-m M --temperature 0.2", lambda a: a.temp == 0.2),
    ("-m M --repeat-penalty 1.1 --repeat-last-n 128 --presence-penalty 0.5 --frequency-penalty 0.25",
     lambda a: (a.repeat_penalty, a.repeat_last_n, a.presence_penalty, a.frequency_penalty) == (1.1, 128, 0.5, 0.25)),
    ("-m M --seed 42 --ignore-eos", lambda a: a.seed == 42 and a.ignore_eos is True),
    ("-m M -s 7", lambda a: a.seed == 7),
    ("-m M --log-disable", lambda a: log_level(a) > logging.CRITICAL),
    ("-m M --log-verbosity 2", lambda a: log_level(a) == logging.WARNING),
    ("-m M -lv 5", lambda a: log_level(a) == logging.DEBUG),
    ("-m M -v", lambda a: log_level(a) == logging.DEBUG and settings(a).verbose),
    ("-m M --verbose", lambda a: settings(a).verbose),
    ("-m M --rpc 10.0.0.2:50052,10.0.0.3:50052 -ngl 99", lambda a: a.rpc == "10.0.0.2:50052,10.0.0.3:50052"),
    ("-m M -dev none", lambda a: device_names(a.device, a.rpc) == ["CPU"]),
    ("-m M -sm none -mg 1", lambda a: a.split_mode == "none" and a.main_gpu == 1),
    ("-m M -ts 3,1", lambda a: a.tensor_split == "3,1"),
    ("-m M -ngl all", lambda a: a.n_gpu_layers == ALL_LAYERS),
    ("-m M -ngl auto", lambda a: a.n_gpu_layers == -1),
    ("-m M --gpu-layers 10", lambda a: a.n_gpu_layers == 10),
    ("-m M --n-gpu-layers 10", lambda a: a.n_gpu_layers == 10),
    ("-m M --embedding --pooling mean", lambda a: a.embedding is True and a.pooling == "mean"),
    ("-m M --embeddings", lambda a: a.embedding is True),
    ("-m M -dt 0.1", lambda a: a.defrag_thold == 0.1),
    ("-m M --no-prefill-assistant", lambda a: a.prefill_assistant is False),
    ("-m M --draft-max 16", lambda a: a.spec_draft_n_max == 16 and a.spec_type == ()),
    ("-m M -md d.gguf -ngld 99 --draft-p-min 0.5 -devd none -td 2 -ctkd q8_0 -cd 512",
     lambda a: (a.model_draft, a.spec_draft_p_min, a.device_draft, a.threads_draft, a.cache_type_k_draft,
                a.ctx_size_draft) == ("d.gguf", 0.5, "none", 2, "q8_0", 512)),
    ("-m M --spec-type none,ngram-simple --spec-draft-n-max 4 --spec-draft-n-min 2",
     lambda a: (a.spec_type, a.spec_draft_n_max, a.spec_draft_n_min) == (("ngram-simple",), 4, 2)),
    ("-m M --spec-type ngram-cache,ngram-map-k --spec-ngram-map-k-size-m 16 --spec-ngram-map-k4v-min-hits 3",
     lambda a: (spec_config(a).kinds, spec_config(a).map_k.m, spec_config(a).map_k4v.min_hits)
     == (("ngram-map-k", "ngram-cache"), 16, 3)),
    ("-m M --spec-default", lambda a: (spec_config(a).kinds, spec_config(a).mod_n_min) == (("ngram-mod",), 48)),
    ("-m M --lora a.gguf,b.gguf --lora-scaled c.gguf:0.5 --lora d.gguf",
     lambda a: lora_adapters(a) == [("a.gguf", 1.0), ("b.gguf", 1.0), ("c.gguf", 0.5), ("d.gguf", 1.0)]),
    ("-m M --lora a.gguf --lora-init-without-apply", lambda a: lora_adapters(a) == [("a.gguf", 0.0)]),
    ("--models-dir d --models-max 0 --no-models-autoload --sleep-idle-seconds 30",
     lambda a: (a.models_dir, a.models_max, a.models_autoload, a.sleep_idle_seconds) == ("d", 0, False, 30)),
    ("--models-preset p.ini --models-memory 512",
     lambda a: (a.models_preset, a.models_max, a.models_autoload, a.models_memory) == ("p.ini", 4, True, 512)),
])
def test_llama_server_command_lines(line, check):
    assert check(parse_args(line.split()))


@pytest.mark.parametrize("line, flag", [
    ("-m M -hf ggml-org/gemma-3-1b-it-GGUF", "-hf"),
    ("-hf x", "-hf"),
    ("--hf-repo x/y --hf-file z.gguf", "--hf-repo"),
    ("-m M --control-vector v.gguf", "--control-vector"),
    ("-m M -md d.gguf -otd x=CPU", "-otd"),
    ("-m M --mmproj mm.gguf", "--mmproj"),
    ("-m M -ot exps=CPU", "-ot"),
    ("-m M --override-tensor exps=CPU", "--override-tensor"),
    ("-m M --spec-draft-n-cpu-moe 2", "--spec-draft-n-cpu-moe"),
    ("-m M --draft-p-split 0.5", "--draft-p-split"),
    ("-m M -gan 4", "-gan"),
    ("-m M --ssl-key-file k.pem", "--ssl-key-file"),
    ("-m M --adaptive-target 0.5", "--adaptive-target"),
    ("-m M -sm row", "--split-mode row"),
])
def test_unsupported_flags_are_one_line_naming_the_flag(line, flag):
    msg = refused(line.split())
    assert flag in msg and "not supported" in msg


def test_every_listed_unsupported_flag_is_refused():
    for flag in UNSUPPORTED:
        msg = refused(["-m", "M", flag, "x"])
        assert msg.startswith(f"{flag}:") and "not supported" in msg


def test_every_llama_server_flag_is_read_or_refused_by_name():
    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    unknown = []
    for flag in LLAMA_SERVER_FLAGS:
        if flag in known:
            continue
        try:
            parse_args(["-m", "M", flag, "x"])
        except PyllamaError as exc:
            if str(exc).startswith(f"{flag}:") and "not supported" in str(exc) and "\n" not in str(exc):
                continue
        except SystemExit:  # argparse's "unrecognized arguments": the flag is not known at all
            pass
        unknown.append(flag)
    assert len(LLAMA_SERVER_FLAGS) > 300 and not unknown, unknown


def test_sleep_idle_seconds_is_for_the_router_only():
    assert "router mode only" in refused(["-m", "M", "--sleep-idle-seconds", "60"])
    assert parse_args(["--models-dir", "d", "--sleep-idle-seconds", "60"]).sleep_idle_seconds == 60


def test_unsupported_flag_with_equals_value():
    assert refused(["-m", "M", "--control-vector=a.gguf"]).startswith("--control-vector:")


def test_unknown_value_of_flash_attn(capsys):
    assert "--flash-attn" in exits(["-fa", "maybe"], capsys)


def test_bad_values_are_one_line(capsys):
    assert "--reasoning-format" in exits(["--reasoning-format", "bogus"], capsys)
    assert "--chat-template-kwargs" in exits(["--chat-template-kwargs", "{not json"], capsys)
    assert "--chat-template-kwargs" in exits(["--chat-template-kwargs", "[1]"], capsys)
    assert "-ngl" in exits(["-ngl", "lots"], capsys)
    assert "--pooling" in exits(["--pooling", "bogus"], capsys)


def test_checks_of_values():
    assert "--cpu-strict 1" in refused(["--cpu-strict", "1"])
    assert "--cache-ram -2" in refused(["--cache-ram", "-2"])
    assert "--poll" in refused(["--poll", "101"])
    assert "--cpu-range" in refused(["-Cr", "3-1"])
    assert "--cpu-mask" in refused(["-Cb", "zz"])
    assert "--parallel" in refused(["-np", "0"])
    assert "--seed" in refused(["--seed", "-5"])
    assert "--repeat-last-n" in refused(["--repeat-last-n", "-2"])
    assert "--timeout" in refused(["--timeout", "0"])
    assert "--slot-save-path" in refused(["--slot-save-path", "/nonexistent/folder"])
    assert "--api-key-file" in refused(["--api-key-file", "/nonexistent/keys"])
    assert "--api-prefix" in refused(["--api-prefix", "llama"])
    assert "--api-prefix" in refused(["--api-prefix", "/llama/"])


# --- exact matching ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, dest, value", [
    (["-ngl", "99"], "n_gpu_layers", 99),
    (["-np", "3"], "parallel", 3),
    (["-tb", "2"], "threads_batch", 2),
    (["-to", "30"], "timeout", 30.0),
    (["-cb"], "cont_batching", True),
    (["-ctk", "q8_0"], "cache_type_k", "q8_0"),
    (["-ctv", "bf16"], "cache_type_v", "bf16"),
    (["-ub", "64"], "ubatch_size", 64),
    (["-sps", "0.3"], "slot_prompt_similarity", 0.3),
    (["-dev", "CPU"], "device", "CPU"),
    (["-ts", "1,1"], "tensor_split", "1,1"),
    (["-sm", "none"], "split_mode", "none"),
    (["-mg", "0"], "main_gpu", 0),
    (["-lv", "4"], "log_verbosity", 4),
    (["-kvu"], "kv_unified", True),
])
def test_multi_letter_short_flags_are_not_clustered(argv, dest, value):
    a = parse_args(argv)
    assert getattr(a, dest) == value
    # none of them is read as a one-letter flag with the rest as its value
    assert a.n_predict == -1 and a.ctx_size == 0 and a.threads == 0 and a.model is None


def test_no_prefix_abbreviations(capsys):
    assert "--ctx" in exits(["--ctx", "100"], capsys)
    assert "--chat-templ" in exits(["--chat-templ", "chatml"], capsys)
    assert "--api" in exits(["--api", "k"], capsys)
    assert "-cx" in exits(["-cx"], capsys)          # not -c with value x
    assert "-tq" in exits(["-tq", "2"], capsys)     # not -t with value q


def test_help_lists_defaults_and_variables():
    text = build_parser().format_help()
    flat = " ".join(text.split())
    assert "(default: 0.1)" in flat and "--slot-prompt-similarity" in flat
    assert "(default: 600.0)" in flat and "LLAMA_ARG_TIMEOUT" in flat
    assert "-1 = auto: 4 slots" in flat and "LLAMA_ARG_N_PARALLEL" in flat
    assert "LLAMA_ARG_N_GPU_LAYERS" in flat and "LLAMA_API_KEY" in flat and "LLAMA_ARG_CTX_SIZE" in flat
    assert "--metrics" in flat and "(default: off)" in flat
    assert "--control-vector" in flat  # the refused llama-server flags are listed


def test_version_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "pyllama" in proc.stderr


def test_unsupported_flag_from_the_program_is_one_line_exit_1():
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", "x.gguf", "--control-vector", "a.gguf"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "--control-vector" in proc.stderr, proc.stderr


# --- environment ------------------------------------------------------------------------------

@pytest.mark.parametrize("var, raw, dest, value", [
    ("LLAMA_ARG_CTX_SIZE", "4096", "ctx_size", 4096),
    ("LLAMA_ARG_ROPE_FREQ_BASE", "1000000", "rope_freq_base", 1e6),
    ("LLAMA_ARG_ROPE_SCALING_TYPE", "yarn", "rope_scaling", "yarn"),
    ("LLAMA_ARG_N_GPU_LAYERS", "99", "n_gpu_layers", 99),
    ("LLAMA_ARG_N_PARALLEL", "3", "parallel", 3),
    ("LLAMA_ARG_THREADS", "2", "threads", 2),
    ("LLAMA_ARG_MODEL", "/models/m.gguf", "model", "/models/m.gguf"),
    ("LLAMA_ARG_HOST", "0.0.0.0", "host", "0.0.0.0"),
    ("LLAMA_ARG_PORT", "9000", "port", 9000),
    ("LLAMA_ARG_BATCH", "256", "batch_size", 256),
    ("LLAMA_ARG_UBATCH", "64", "ubatch_size", 64),
    ("LLAMA_ARG_N_PREDICT", "32", "n_predict", 32),
    ("LLAMA_ARG_FLASH_ATTN", "on", "flash_attn", "on"),
    ("LLAMA_ARG_CACHE_TYPE_K", "q8_0", "cache_type_k", "q8_0"),
    ("LLAMA_ARG_CONT_BATCHING", "0", "cont_batching", False),
    ("LLAMA_ARG_ENDPOINT_METRICS", "1", "metrics", True),
    ("LLAMA_ARG_ENDPOINT_SLOTS", "false", "slots", False),
    ("LLAMA_ARG_ENDPOINT_PROPS", "true", "props", True),
    ("LLAMA_ARG_NO_MMAP", "1", "mmap", False),
    ("LLAMA_ARG_MMAP", "0", "mmap", False),
    ("LLAMA_ARG_REPACK", "0", "repack", False),
    ("LLAMA_ARG_MLOCK", "1", "mlock", True),
    ("LLAMA_ARG_JINJA", "0", "jinja", False),
    ("LLAMA_ARG_CHAT_TEMPLATE", "llama3", "chat_template", "llama3"),
    ("LLAMA_ARG_TIMEOUT", "30", "timeout", 30.0),
    ("LLAMA_ARG_ALIAS", "a,b", "alias", ["a", "b"]),
    ("LLAMA_ARG_DEVICE", "CPU", "device", "CPU"),
    ("LLAMA_ARG_RPC", "h:1", "rpc", "h:1"),
    ("LLAMA_ARG_CONTEXT_SHIFT", "1", "context_shift", True),
    ("LLAMA_ARG_KV_UNIFIED", "0", "kv_unified", False),
    ("LLAMA_ARG_TOP_K", "5", "top_k", 5),
    ("LLAMA_ARG_THINK", "deepseek", "reasoning_format", "deepseek"),
    ("LLAMA_ARG_THINK_BUDGET", "0", "reasoning_budget", 0),
    ("LLAMA_ARG_REASONING", "off", "reasoning", "off"),
    ("LLAMA_ARG_SSE_PING_INTERVAL", "-1", "sse_ping_interval", -1.0),
    ("LLAMA_ARG_EMBEDDINGS", "1", "embedding", True),
    ("LLAMA_ARG_UI", "0", "webui", False),
    ("LLAMA_ARG_NO_UI", "1", "webui", False),
    ("LLAMA_ARG_CACHE_PROMPT", "0", "cache_prompt", False),
    ("LLAMA_ARG_PERF", "1", "perf", True),
    ("LLAMA_ARG_FIT", "off", "fit", "off"),
    ("LLAMA_ARG_MODELS_DIR", "/models", "models_dir", "/models"),
    ("LLAMA_ARG_MODELS_PRESET", "/p.ini", "models_preset", "/p.ini"),
    ("LLAMA_ARG_MODELS_MAX", "2", "models_max", 2),
    ("LLAMA_ARG_MODELS_AUTOLOAD", "0", "models_autoload", False),
])
def test_llama_arg_variables(monkeypatch, var, raw, dest, value):
    monkeypatch.setenv(var, raw)
    assert getattr(parse_args([]), dest) == value


def test_api_key_variable_and_file(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_API_KEY", "s1,s2")
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nk3\n\n  k4  \n")
    assert settings(parse_args(["--api-key-file", str(keys)])).api_keys == ["s1", "s2", "k3", "k4"]


def test_precedence_command_line_then_pyllama_then_llama(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "64")
    assert parse_args([]).ctx_size == 64
    monkeypatch.setenv("PYLLAMA_ARG_CTX_SIZE", "128")
    assert parse_args([]).ctx_size == 128
    assert parse_args(["-c", "256"]).ctx_size == 256
    monkeypatch.setenv("LLAMA_ARG_N_PARALLEL", "2")
    monkeypatch.setenv("PYLLAMA_ARG_PARALLEL", "6")
    assert parse_args([]).parallel == 6
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_SLOTS", "0")
    assert parse_args(["--slots"]).slots is True


def test_bad_variable_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_ARG_N_PARALLEL", "many")
    assert "LLAMA_ARG_N_PARALLEL" in exits([], capsys)
    monkeypatch.delenv("LLAMA_ARG_N_PARALLEL")
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_METRICS", "perhaps")
    assert "LLAMA_ARG_ENDPOINT_METRICS" in exits([], capsys)


def test_variable_of_unsupported_flag_is_refused(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_HF_REPO", "ggml-org/x")
    assert "LLAMA_ARG_HF_REPO" in refused([])


def test_rpc_server_ignores_the_server_variables(monkeypatch):
    from pyllama.rpc_server.__main__ import build_parser as rpc_parser
    base = rpc_parser().parse_args([])
    for var, raw in (("LLAMA_ARG_DEVICE", "CUDA3"), ("PYLLAMA_ARG_DEVICE", "RPC0,CPU"), ("LLAMA_ARG_PORT", "1"),
                     ("LLAMA_ARG_HOST", "0.0.0.0"), ("LLAMA_ARG_THREADS", "99"), ("LLAMA_ARG_N_GPU_LAYERS", "5")):
        monkeypatch.setenv(var, raw)
    assert vars(rpc_parser().parse_args([])) == vars(base)


# --- what the flags do ------------------------------------------------------------------------

def test_ngl_counts_the_output_layer_first():
    # 12 blocks: -ngl 1 = only the output layer, -ngl 5 = output + the last 4 blocks, 13+ = all
    assert plan_devices(["RPC0", "CPU"], 12, 1) == (["CPU", "RPC0"], [12.0, 0.0])
    assert plan_devices(["RPC0", "CPU"], 12, 5) == (["CPU", "RPC0"], [8.0, 4.0])
    assert plan_devices(["RPC0", "CPU"], 12, 13) == (["RPC0"], [12.0])
    assert plan_devices(["RPC0", "CPU"], 12, 99) == (["RPC0"], [12.0])
    assert plan_devices(["RPC0", "CPU"], 12, 0) == (["CPU"], None)


def test_ngl_goes_to_the_non_cpu_devices_in_order_by_tensor_split():
    assert plan_devices(["RPC0", "RPC1", "CPU"], 12, 9, tensor_split="3,1") == (["CPU", "RPC0", "RPC1"],
                                                                               [4.0, 6.0, 2.0])
    assert plan_devices(["RPC1", "RPC0"], 12, 99) == (["RPC1", "RPC0"], [6.0, 6.0])


def test_ngl_without_a_non_cpu_device_changes_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="pyllama.runtime.placement.devices"):
        assert plan_devices(["CPU"], 12, 99) == (["CPU"], None)
    assert "-ngl 99" in caplog.text


def test_split_mode_none_and_main_gpu():
    assert plan_devices(["RPC0", "RPC1", "CPU"], 12, 99, split_mode="none", main_gpu=1) == (["RPC1"], None)
    with pytest.raises(PyllamaError, match="--main-gpu 2"):
        plan_devices(["RPC0", "CPU"], 12, 99, split_mode="none", main_gpu=2)


def test_sampling_flags_become_the_request_defaults():
    a = parse_args("--temp 0.3 --top-k 7 --top-p 0.5 --min-p 0.2 --repeat-penalty 1.3 --repeat-last-n 32 "
                   "--presence-penalty 0.4 --frequency-penalty 0.6 --seed 11 --ignore-eos".split())
    from pyllama.server.options import sampling_defaults
    try:
        params.set_generation_defaults(sampling_defaults(a), a.ignore_eos)
        p = params.parse_completion({}, -1, 1)
        s = p.sampling
        assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.repeat_last_n, s.presence_penalty,
                s.frequency_penalty, s.seed, p.ignore_eos) == (0.3, 7, 0.5, 0.2, 1.3, 32, 0.4, 0.6, 11, True)
        q = params.parse_completion({"temperature": 1.5, "ignore_eos": False}, -1, 1)
        assert q.sampling.temperature == 1.5 and q.sampling.top_k == 7 and q.ignore_eos is False
    finally:
        params.set_generation_defaults()
    assert params.parse_completion({}, -1, 1).sampling == SamplingParams()


@pytest.mark.parametrize("text, expected", [
    (r"a\nb", "a\nb"), (r"\r\t\'\"\\", "\r\t'\"\\"), (r"\x41\x", "A\\x"), (r"\q", "\\q"), ("end\\", "end\\"),
    (r"\xc3\xa9", "\u00e9"), (r"\xff", "\ufffd"), ("plain", "plain"),
])
def test_process_escapes(text, expected):
    assert process_escapes(text) == expected


def test_escapes_in_reverse_prompts_and_dry_breakers():
    a = parse_args(["-r", r"\n\nUser:", "--reverse-prompt", "END", "--dry-sequence-breaker", r"\n"])
    assert default_stop(a) == ("\n\nUser:", "END")
    assert sampling_defaults(a).dry_sequence_breakers == ("\n",)
    b = parse_args(["--no-escape", "-r", r"\n", "--dry-sequence-breaker", r"\t"])
    assert default_stop(b) == (r"\n",) and sampling_defaults(b).dry_sequence_breakers == (r"\t",)
    assert default_stop(parse_args([])) == ()


def test_logit_bias_flag_is_the_default_a_request_replaces():
    """llama-server's: --logit-bias biases every request that gives no logit_bias (repeated tokens add
    up, -inf bans); a request's own logit_bias (even an empty one) replaces it."""
    from pyllama.server.options import sampling_defaults
    a = parse_args("-m M -l 15043+1 --logit-bias 7-inf -l 15043+0.5 -l 9-0.25".split())
    try:
        params.set_generation_defaults(sampling_defaults(a))
        ids, bias = params.parse_completion({}, -1, 1).sampling.logit_bias
        assert ids.tolist() == [7, 9, 15043] and bias.tolist() == [-np.inf, -0.25, 1.5]
        ids, bias = params.parse_completion({"logit_bias": [[3, 2.0]]}, -1, 1).sampling.logit_bias
        assert ids.tolist() == [3] and bias.tolist() == [2.0]
        assert params.parse_completion({"logit_bias": []}, -1, 1).sampling.logit_bias is None
        with pytest.raises(PyllamaError, match="--logit-bias: token 15043 is outside the vocabulary of 512"):
            params.check_generation_defaults(512)
        params.check_generation_defaults(32000)
    finally:
        params.set_generation_defaults()
    assert params.parse_completion({}, -1, 1).sampling.logit_bias is None


@pytest.mark.parametrize("value", ["15043", "abc+1", "5+inf", "5*2", "+1", "5+", "-3+1"])
def test_bad_logit_bias_flag_is_one_line(value, capsys):
    assert "--logit-bias" in exits(["-m", "M", "-l", value], capsys)


def test_reverse_prompt_and_cache_prompt_become_request_defaults():
    a = parse_args(["-r", "END", "--no-cache-prompt"])
    try:
        params.set_generation_defaults(sampling_defaults(a), a.ignore_eos, a.cache_prompt, default_stop(a))
        p = params.parse_completion({}, -1, 1)
        assert p.stop == ["END"] and p.cache_prompt is False
        q = params.parse_completion({"stop": ["x"], "cache_prompt": True}, -1, 1)
        assert q.stop == ["x"] and q.cache_prompt is True
        # no stop string given (an empty list included): the command line's, as llama-server
        assert params.parse_completion({"stop": []}, -1, 1).stop == ["END"]
    finally:
        params.set_generation_defaults()
    p = params.parse_completion({}, -1, 1)
    assert p.stop == [] and p.cache_prompt is True


def test_fit_off_is_accepted_and_on_refused():
    assert parse_args(["-fit", "off"]).fit == "off" and parse_args(["--fit", "off"]).fit == "off"
    msg = refused(["--fit", "on"])
    assert msg.startswith("--fit on:") and "not supported" in msg


def test_embd_normalize_is_the_embeddings_default():
    assert settings(parse_args(["--embd-normalize", "-1"])).embd_normalize == -1
    assert settings(parse_args([])).embd_normalize == 2
    assert "--embd-normalize -2" in refused(["--embd-normalize", "-2"])


def test_flags_accepted_without_effect():
    a = parse_args(["--perf", "--no-warmup", "-sp", "-e"])
    assert (a.perf, a.warmup, a.special, a.escape) == (True, False, True, True)
    b = parse_args(["--no-perf", "--warmup", "--no-escape"])
    assert (b.perf, b.warmup, b.special, b.escape) == (False, True, False, False)


def test_usage_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--usage"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("usage:")


def test_special_renders_control_tokens_in_probabilities():
    from pyllama.models.gguf_file import read_metadata
    from pyllama.batching.slot import token_probs
    from pyllama.tokenizer import load_tokenizer
    vocab = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
    tok = load_tokenizer(read_metadata(vocab), str(vocab))
    top = np.array([50256, 15496]), np.array([0.6, 0.4])
    hidden = token_probs(tok, 50256, 0.6, *top, 2)
    shown = token_probs(tok, 50256, 0.6, *top, 2, special=True)
    assert hidden["token"] == "" and shown["token"] == "<|endoftext|>"
    assert [e["token"] for e in shown["top_logprobs"]] == ["<|endoftext|>", "Hello"]


def test_ui_config_file_and_bad_values(tmp_path, capsys):
    f = tmp_path / "ui.json"
    f.write_text('{"showTokensPerSecond": true}')
    assert settings(parse_args(["-m", "M", "--ui-config-file", str(f)])).ui_settings == {"showTokensPerSecond": True}
    f.write_text("[1, 2]")
    assert "--ui-config-file" in refused(["-m", "M", "--ui-config-file", str(f)])
    assert "--ui-config-file" in refused(["-m", "M", "--ui-config-file", str(tmp_path / "missing.json")])
    assert "--ui-config" in exits(["-m", "M", "--ui-config", "{not json"], capsys)


def test_chat_template_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert parse_args(["--chat-template-file", str(f)]).chat_template == f.read_text()


# --- real starts with the tiny model ----------------------------------------------------------

def test_start_with_llama_server_flags(tiny_model, tmp_path):
    log_file = tmp_path / "server.log"
    srv = ServerProcess(tiny_model, "--log-file", str(log_file), "-c", "256", "-np", "2", "-ngl", "99", "-fa", "on",
                        "-cb", "--jinja", "--metrics",
                        "--temp", "0", "--top-k", "1", "--seed", "5", "--chat-template", "llama3", "--no-mmap",
                        "-a", "first,second", "-to", "30", "-sps", "0.2", "-ctk", "q8_0", "-ctv", "q8_0",
                        "--threads-http", "4", "-tb", "1").wait_ready()
    try:
        status, props = srv.request("GET", "/props")
        assert status == 200
        gen = props["default_generation_settings"]["params"]
        assert gen["temperature"] == 0 and gen["top_k"] == 1 and gen["seed"] == 5
        assert props["chat_template"] == "llama3"
        assert props["model_alias"] == "first"
        status, _ = srv.request("GET", "/metrics")
        assert status == 200
    finally:
        assert srv.stop() == 0
    assert "-fa on: attention is always one fused kernel" in srv.stderr_text
    assert "listening on" in log_file.read_text()


def test_logit_bias_flag_in_a_server(tiny_model):
    prompt = "The little cat sat on the mat"
    first = generated_tokens(tiny_model, prompt, 1)[0]
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "return_tokens": True}
    srv = ServerProcess(tiny_model, "-c", "256", "-np", "1", "-l", f"{first}-inf").wait_ready()
    try:
        status, doc = srv.post("/completion", body)
        assert status == 200 and doc["tokens"] != [first]
        assert doc["generation_settings"]["logit_bias"] == [{"bias": None, "token": first}]
        status, doc = srv.post("/completion", {**body, "logit_bias": []})
        assert status == 200 and doc["tokens"] == [first]
    finally:
        assert srv.stop() == 0
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", tiny_model, "--port", "0", "-c", "128",
                           "-l", "999999+1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --logit-bias: token 999999 is outside the vocabulary of 512 tokens"], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("program", ["pyllama.server", "pyllama.generate"])
def test_list_devices(program):
    """llama.cpp's form: the devices besides the CPU, with their memory; '(none)' on a CPU-only
    machine without --rpc."""
    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", program, "--list-devices", *extra], capture_output=True,
                              text=True, timeout=60)
    alone = run()
    assert alone.returncode == 0
    cuda = "CUDA0:" in alone.stdout
    if not cuda:
        assert alone.stdout == "Available devices:\n  (none)\n"
    peer = RPCServerProcess("--mem", "512")
    try:
        listed = run("--rpc", peer.endpoint)
    finally:
        assert peer.stop() == 0
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == "Available devices:"
    assert lines[1] == f"  RPC0: CPU (cpu) at {peer.endpoint} (512 MiB, 512 MiB free)"
    assert len(lines) == 2 or cuda


def test_no_kv_offload_holds_or_is_refused():
    from pyllama.runtime.placement.devices import check_kv_offload
    check_kv_offload(["CPU"], [0, 0], False)             # every layer local: the cache is in host memory
    check_kv_offload(["RPC0", "CPU"], [0, 1], True)      # the default: each cache on its layer's device
    with pytest.raises(PyllamaError, match="--no-kv-offload: layers are on RPC0"):
        check_kv_offload(["RPC0", "CPU"], [0, 1], False)


def test_cpu_moe_holds_or_is_refused():
    from pyllama.runtime.placement.devices import check_cpu_moe
    check_cpu_moe(["CPU"], [0, 0, 0, 0], True, 4)          # every layer on the CPU: it holds
    check_cpu_moe(["RPC0", "CPU"], [0, 0, 1, 1], False, 4)  # a dense model has no experts
    check_cpu_moe(["RPC0", "CPU"], [1, 1, 0, 0], True, 2)   # the first 2 layers are local
    with pytest.raises(PyllamaError, match="layers 0-1 are on RPC0"):
        check_cpu_moe(["RPC0", "CPU"], [0, 0, 1, 1], True, 4)


def test_cpu_moe_in_a_server(model_factory, rpc_peer):
    moe_model = model_factory("tiny", arch="qwen3moe")
    refused = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", moe_model, "--port", "0", "-c", "128",
                              "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU", "-cmoe"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "error: --cpu-moe/--n-cpu-moe: layers 0-0 are on RPC0" in refused.stderr
    refused = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", moe_model, "--port", "0", "-c", "128",
                              "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU", "-nkvo"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "error: --no-kv-offload: layers are on RPC0" in refused.stderr
    srv = ServerProcess(moe_model, "-c", "128", "-np", "1", "-cmoe", "--numa", "distribute").wait_ready()
    try:
        status, _ = srv.post("/completion", {"prompt": "hi", "n_predict": 2})
        assert status == 200
    finally:
        assert srv.stop() == 0
    assert "--numa distribute: pyllama places no memory or threads by NUMA node" in srv.stderr_text


def test_warm_up_runs_before_serving_and_leaves_no_trace(tiny_model):
    outputs = []
    for flags in ((), ("--no-warmup",)):
        srv = ServerProcess(tiny_model, "-c", "256", "-np", "2", *flags).wait_ready()
        try:
            status, doc = srv.request("POST", "/completion", {"prompt": "Once upon a time", "n_predict": 8,
                                                              "temperature": 0, "id_slot": 0})
            assert status == 200, doc
            outputs.append((doc["content"], doc["tokens_evaluated"], doc["tokens_cached"]))
        finally:
            assert srv.stop() == 0
        assert ("warm-up: one decode step in each of 1 pipeline group(s)" in srv.stderr_text) == (not flags)
    assert outputs[0] == outputs[1]


def test_no_mmap_copies_the_weights(tiny_model):
    from pyllama.runtime.engine import Engine
    mapped = Engine(tiny_model, n_threads=1)
    copied = Engine(tiny_model, n_threads=1, map_weights=False)
    try:
        n_file = len(copied.model.file.tensors)
        assert sum(len(infos) for _, infos, _ in copied.weights.sources) == n_file
        assert sum(len(infos) for _, infos, _ in mapped.weights.sources) < n_file
    finally:
        mapped.close()
        copied.close()


def test_mlock_locks_or_says_why(caplog):
    from pyllama.server.options import lock_memory
    with caplog.at_level(logging.INFO, logger="pyllama.server"):
        lock_memory()
    assert "--mlock: the process's memory is locked in RAM" in caplog.text or "mlockall failed" in caplog.text


def test_start_from_llama_arg_variables(tiny_model):
    env = {"LLAMA_ARG_CTX_SIZE": "256", "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_API_KEY": "secret",
           "LLAMA_ARG_ENDPOINT_SLOTS": "0"}
    srv = ServerProcess(tiny_model, env=env).wait_ready()
    try:
        status, _ = srv.request("GET", "/props")
        assert status == 401
        status, props = srv.request("GET", "/props", headers={"Authorization": "Bearer secret"})
        assert status == 200 and props["total_slots"] == 2
        status, _ = srv.request("GET", "/slots", headers={"Authorization": "Bearer secret"})
        assert status == 501
        status, _ = srv.request("GET", "/metrics", headers={"Authorization": "Bearer secret"})
        assert status == 501  # no --metrics
    finally:
        assert srv.stop() == 0


def test_default_parallel_is_auto(tiny_model):
    srv = ServerProcess(tiny_model, "-c", "256").wait_ready()
    try:
        status, props = srv.request("GET", "/props")
        assert status == 200 and props["total_slots"] == 4
        # unified KV: one request may use the whole context, not a quarter of it
        status, doc = srv.request("POST", "/completion", {"prompt": [1] * 100, "n_predict": 1})
        assert status == 200, doc
    finally:
        assert srv.stop() == 0


def test_bad_chat_template_name_fails_at_start(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", tiny_model, "--port", "0", "-c", "128",
                           "--chat-template", "llama-three"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "llama-three" in proc.stderr and "built-in template name" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr


@pytest.mark.parametrize("ngl, layers", [("99", "RPC0 0-{last} + output"),
                                         ("2", "CPU 0-{cpu_last}, RPC0 {last}-{last} + output"),
                                         ("0", "CPU 0-{last} + output")])
def test_ngl_over_an_rpc_server(tiny_model, ngl, layers):
    """llama-server's `--rpc HOST:PORT -ngl N`: the output layer and the last N-1 blocks on the peer."""
    from pyllama.models.model import Model
    from server_util import RPCServerProcess
    n_layer = Model(tiny_model).hparams.n_layer
    want = layers.format(last=n_layer - 1, cpu_last=n_layer - 2)
    peer = RPCServerProcess()
    try:
        srv = ServerProcess(tiny_model, "--rpc", peer.endpoint, "-ngl", ngl, "-c", "256", "-np", "1").wait_ready()
        try:
            status, doc = srv.request("POST", "/completion", {"prompt": "Hello", "n_predict": 2})
            assert status == 200, doc
        finally:
            assert srv.stop() == 0
    finally:
        peer.stop()
    assert f"layers: {want}" in srv.stderr_text, srv.stderr_text[-2000:]
