"""A model with more logits than tokenizer entries (Qwen3 pads 151669 tokens to 151936 rows):
the padding rows have no text and must never be sampled, however large their logits."""
import json

import numpy as np
from safetensors.numpy import load_file, save_file

import tiny_models as tm

PAD = 40


def padded_model(root):
    spec = tm.SPECS["llama_twin"]
    directory = tm.write_hf(root / "padded", spec, tm.hf_weights(spec, seed=3))
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] = tm.VOCAB + PAD
    (directory / "config.json").write_text(json.dumps(config))
    w = load_file(str(directory / "model.safetensors"))
    hidden = spec["hidden"]
    rng = np.random.default_rng(0)
    w["model.embed_tokens.weight"] = np.concatenate(
        [w["model.embed_tokens.weight"], rng.standard_normal((PAD, hidden)).astype(np.float32)])
    # Large padding rows: whichever sign the final hidden state has, some padding logit is huge.
    pad_rows = 30.0 * np.concatenate([np.ones((PAD // 2, hidden)), -np.ones((PAD // 2, hidden))])
    pad_rows *= rng.uniform(0.5, 1.5, (PAD, hidden))
    w["lm_head.weight"] = np.concatenate([w["lm_head.weight"], pad_rows]).astype(np.float32)
    save_file(w, str(directory / "model.safetensors"))
    return directory


def test_padding_logits_are_never_sampled(test_tmp, run_spin):
    model = padded_model(test_tmp)
    out = test_tmp / "padded_ids.json"
    # The padding rows win the raw argmax somewhere in the prompt (so the test can fail).
    logits_file = test_tmp / "padded_logits.npy"
    run_spin("generate", "--model", model, "--prompt-ids", "5,6,7,8,9,10", "-n", "0",
             "--logits-out", logits_file)
    logits = np.load(logits_file)
    assert logits.shape[1] == tm.VOCAB + PAD
    assert (logits.argmax(axis=1) >= tm.VOCAB).any(), "padding rows never dominate: test is vacuous"
    for extra in (["--temperature", "0"], ["--temperature", "1.5", "--top-k", "0", "--top-p", "1",
                                           "--min-p", "0", "--seed", "11"]):
        run_spin("generate", "--model", model, "--prompt-ids", "5,6,7,8,9,10", "-n", "48",
                 "--ignore-eos", "--ids-out", out, *extra)
        ids = json.loads(out.read_text())["output_ids"]
        assert len(ids) == 48
        assert max(ids) < tm.VOCAB, ids
