"""Flag errors of `spin generate` (and out-of-range flags of serve and eval): each mistake fails
before the model loads, with a message naming the flag; a near-zero temperature draws the greedy
tokens, not garbage; and a --max-tokens the context cannot hold is said up front."""
import json

TINY = ["--model", "tiny-llama", "--load-format", "dummy"]


def test_empty_prompt_is_named(run_spin):
    for flag in ("--prompt", "--prompt-ids"):
        proc = run_spin("generate", *TINY, flag, "", "-n", 1, expect_ok=False)
        assert f"{flag} is empty" in proc.stderr


def test_system_without_chat_is_refused(run_spin):
    proc = run_spin("generate", *TINY, "--prompt-ids", "1,2", "--system", "be brief", "-n", 1, expect_ok=False)
    assert "--system needs --chat" in proc.stderr


def test_unwritable_ids_out_fails_before_generating(run_spin, test_tmp):
    missing_dir = test_tmp / "no-such-dir" / "ids.json"
    for flag in ("--ids-out", "--logits-out"):
        proc = run_spin("generate", *TINY, "--prompt-ids", "1,2", "-n", 4, flag, missing_dir, expect_ok=False)
        assert f"{flag}: cannot write" in proc.stderr
        assert "loaded" not in proc.stderr, "the path must be checked before the model loads"
        assert proc.stdout == ""


def test_tiny_temperature_draws_greedily(run_spin, test_tmp):
    outputs = {}
    for temperature in ("0", "1e-40"):
        path = test_tmp / f"ids_t{temperature}.json"
        run_spin("generate", *TINY, "--prompt-ids", "5,6,7,8", "-n", 12, "--temperature", temperature,
                 "--top-k", 0, "--top-p", 1, "--min-p", 0, "--seed", 3, "--ignore-eos", "--ids-out", path)
        outputs[temperature] = json.loads(path.read_text())["output_ids"]
    assert len(outputs["0"]) == 12
    assert outputs["1e-40"] == outputs["0"]


def test_max_tokens_past_the_context_is_announced(run_spin, test_tmp):
    path = test_tmp / "ids_clamped.json"
    proc = run_spin("generate", *TINY, "--prompt-ids", "5,6,7", "-n", 40, "--max-context", 16, "--temperature", 0,
                    "--ignore-eos", "--ids-out", path)
    assert "--max-tokens 40 does not fit the context of 16 tokens after a 3-token prompt: at most 13" in proc.stderr
    result = json.loads(path.read_text())
    assert len(result["output_ids"]) == 13
    assert result["finish_reason"] == "length"
    quiet = run_spin("generate", *TINY, "--prompt-ids", "5,6,7", "-n", 13, "--max-context", 16, "--temperature", 0,
                     "--ignore-eos")
    assert "does not fit" not in quiet.stderr


def test_out_of_range_flags_are_named(run_spin):
    for command, flag, value in (("serve", "--threads", -1), ("serve", "--max-model-len", -5),
                                 ("serve", "--kv-cache-tokens", "1x"), ("serve", "--kv-buffer-factor", 65),
                                 ("serve", "--gpu-memory-utilization", 2), ("generate", "--threads", 100000),
                                 ("eval", "--threads", -2)):
        proc = run_spin(command, *TINY, flag, value, expect_ok=False)
        assert proc.stderr.startswith(f"{flag}: "), proc.stderr
        assert str(value) in proc.stderr
