"""spin's tokenizer against HF `tokenizers` built from the same vocabulary and merges.

SmolLM2 (the default model): the vocabulary and merges are read out of the GGUF with the
`gguf` package. SmolLM2's HF tokenizer.json is not available offline, so its pre-tokenizer is
rebuilt here: Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)]. That is what the SmolLM/StarCoder2 tokenizer family ships, and it is what
llama.cpp's "smollm" pre-type encodes (split every \\p{N} first, then the GPT-2 regex); the
exact-id agreement on the whole corpus below (digit runs of every length, each of which would
tokenize differently without the Digits step) confirms it.

Llama-3 and Qwen2 split regexes: small BPE vocabularies are trained with HF's BpeTrainer on the
corpus itself, saved as tokenizer.json and compared.
"""
import json
import os
import subprocess
import unicodedata

import gguf
import jinja2
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPIN = os.environ["SPIN_BIN"]
MODEL = os.environ["SPIN_TEST_MODEL"]
DATA = os.environ["SPIN_TEST_DATA"]
TMP = os.environ["SPIN_TEST_TMP"]

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Written for these tests: Llama 3's chat format (bos, header, trimmed content, eot).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Written for these tests: Llama 3.1's format (a system block that is always present, opening
# with the knowledge cutoff and a fixed date).
LLAMA31_TEMPLATE = (
    "{{ bos_token }}{% set date_string = \"26 Jul 2024\" %}"
    "{% if messages and messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] | trim %}"
    "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{ 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{ 'Today Date: ' + date_string + '\\n\\n' }}{{ sys }}{{ '<|eot_id|>' }}"
    "{% for m in rest %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Written for these tests: a ChatML template with its own default system prompt.
CHATML_TEMPLATE = (
    "{% if messages and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou answer briefly; you are a test fixture.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "  padded question \n"}, {"role": "assistant", "content": "An answer."},
     {"role": "user", "content": "\u4e2d\u6587 and emoji \U0001F600 follow-up"}],
    [{"role": "system", "content": "Multi\nline\nsystem"}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],
]


def load_corpus():
    with open(os.path.join(DATA, "tokenizer_corpus.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


CORPUS = load_corpus()


def tmp_path(*parts):
    path = os.path.join(TMP, "tokenizer", *parts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def run_spin(*args, check=True):
    proc = subprocess.run([SPIN, "tokenize", *args], capture_output=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc


def spin_encode_all(model, strings, no_special=False):
    path = tmp_path("in.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for s in strings:
            f.write(json.dumps(s) + "\n")
    args = ["--model", model, "--jsonl-in", path] + (["--no-special"] if no_special else [])
    out = run_spin(*args).stdout.decode().split("\n")[:-1]
    assert len(out) == len(strings)
    return [json.loads(line) for line in out]


def spin_decode_all(model, id_lists):
    path = tmp_path("ids.jsonl")
    with open(path, "w") as f:
        for ids in id_lists:
            f.write(json.dumps(ids) + "\n")
    out = run_spin("--model", model, "--decode-jsonl", path).stdout.decode().split("\n")[:-1]
    assert len(out) == len(id_lists)
    return [json.loads(line) for line in out]


def assert_same_ids(hf, model, strings, no_special=False):
    hf.encode_special_tokens = no_special
    expected = [hf.encode(s).ids for s in strings]
    hf.encode_special_tokens = False
    got = spin_encode_all(model, strings, no_special)
    mismatches = [(s, e, g) for s, e, g in zip(strings, expected, got) if e != g]
    assert not mismatches, f"{len(mismatches)} of {len(strings)} differ; first: {mismatches[0]!r}"
    return got


@pytest.fixture(scope="module")
def smollm_reader():
    return gguf.GGUFReader(MODEL)


@pytest.fixture(scope="module")
def smollm_hf(smollm_reader):
    reader = smollm_reader
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    hf.decoder = decoders.ByteLevel()
    # GGUF token type 3 = control (a special added token), 4 = user-defined (a plain added token).
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t == 3])
    hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == 4])
    assert any(t == 3 for t in types)
    return hf


def test_corpus_is_large_and_varied():
    assert len(CORPUS) >= 300
    joined = "".join(CORPUS)
    for probe in ["<|im_start|>", "\u4e2d", "\u0627", "\U0001F600", "\u200d", "0123456789", " " * 100]:
        assert probe in joined


def test_smollm_gguf_matches_hf(smollm_hf):
    assert_same_ids(smollm_hf, MODEL, CORPUS)


def test_smollm_gguf_no_special_matches_hf(smollm_hf):
    with_specials = [s for s in CORPUS if "<|" in s or "<repo_name>" in s or "<jupyter" in s]
    assert len(with_specials) >= 10
    assert_same_ids(smollm_hf, MODEL, with_specials, no_special=True)


def test_smollm_roundtrip(smollm_hf):
    ids = spin_encode_all(MODEL, CORPUS)
    decoded = spin_decode_all(MODEL, ids)
    # A string holding a byte the vocabulary has no token for (SmolLM2 lacks e.g. 0x1D) cannot
    # round-trip in spin or HF; for those, spin must agree with HF's decode instead.
    vocab = smollm_hf.get_vocab()
    representable = [all(byte_level_char(b) in vocab for b in s.encode()) for s in CORPUS]
    assert sum(representable) >= len(CORPUS) - 3
    bad = [(s, d) for s, d, ok in zip(CORPUS, decoded, representable) if ok and s != d]
    assert not bad, f"{len(bad)} strings do not round-trip; first: {bad[0]!r}"
    hf_decoded = [smollm_hf.decode(i, skip_special_tokens=False) for i in ids]
    assert hf_decoded == decoded


def test_long_inputs_match_hf(smollm_hf):
    long_inputs = [" " * 20000 + "x", "ab" * 20000, "\n \n" * 5000, "9" * 10000,
                   "word " * 4000, "\u4e2d\u6587" * 3000, "!?" * 10000 + "\U0001F600" * 1000]
    assert_same_ids(smollm_hf, MODEL, long_inputs)


def test_smollm_text_file_and_plain_output(smollm_hf):
    text = "File input: it's 2024 \U0001F600\n<|im_start|>user\nhi<|im_end|>\n"
    path = tmp_path("text.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    expected = smollm_hf.encode(text).ids
    got_json = json.loads(run_spin("--model", MODEL, "--file", path, "--json").stdout)
    got_plain = [int(x) for x in run_spin("--model", MODEL, "--text", text).stdout.split()]
    assert got_json == expected and got_plain == expected
    decoded = run_spin("--model", MODEL, "--decode", ",".join(map(str, expected))).stdout
    assert decoded.decode() == text


def byte_level_char(b):
    """GPT-2's byte -> printable char table, written out independently of spin."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def test_invalid_utf8_roundtrips_bytewise(smollm_hf):
    # HF cannot take invalid UTF-8 (its input is a str); spin keeps such bytes as byte tokens.
    # Bytes that have no token at all (SmolLM2 has none for 0xF5..0xFF, which UTF-8 never
    # uses) are dropped, as HF drops characters it has no token for.
    data = (b"ok \xff\xfe bad \x80 stray \xe2\x82 cut \xed\xa0\x80 surrogate \xc0\xaf overlong "
            b"\xf0\x9f\x98\x80 end\xe2")
    vocab = smollm_hf.get_vocab()
    kept = bytes(b for b in data if byte_level_char(b) in vocab)
    assert kept != data and len(kept) >= len(data) - 4
    path = tmp_path("invalid.bin")
    with open(path, "wb") as f:
        f.write(data)
    ids = json.loads(run_spin("--model", MODEL, "--file", path, "--json").stdout)
    decoded = run_spin("--model", MODEL, "--decode", ",".join(map(str, ids))).stdout
    assert decoded == kept
    # The valid prefix tokenizes as HF tokenizes it.
    assert ids[:len(smollm_hf.encode("ok ").ids)] == smollm_hf.encode("ok ").ids


def test_smollm_tokenizer_json_matches_hf(smollm_hf):
    directory = os.path.dirname(tmp_path("smollm", "tokenizer.json"))
    smollm_hf.save(os.path.join(directory, "tokenizer.json"))
    assert_same_ids(smollm_hf, directory, CORPUS)


def test_smollm_chat_template_matches_jinja(smollm_reader):
    source = smollm_reader.fields["tokenizer.chat_template"].contents()
    template = jinja2.Environment().from_string(source)
    for conversation in CONVERSATIONS:
        path = tmp_path("chat.json")
        with open(path, "w") as f:
            json.dump(conversation, f)
        got = json.loads(run_spin("--model", MODEL, "--chat-json", path, "--json").stdout)
        assert got == template.render(messages=conversation, add_generation_prompt=True)


def train_bpe(name, pattern, specials, template, ignore_merges=False, bos=None, eos=None):
    """A BPE over the corpus with the given split regex; saved with its tokenizer_config.json."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator(CORPUS * 2, trainer=trainer)
    directory = os.path.dirname(tmp_path(name, "tokenizer.json"))
    path = os.path.join(directory, "tokenizer.json")
    hf.save(path)
    if ignore_merges:
        doc = json.load(open(path, encoding="utf-8"))
        doc["model"]["ignore_merges"] = True
        json.dump(doc, open(path, "w", encoding="utf-8"))
        hf = Tokenizer.from_file(path)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "bos_token": bos, "eos_token": eos}, f)
    return hf, directory


@pytest.mark.parametrize("ignore_merges", [False, True])
def test_llama3_regex_matches_hf(ignore_merges):
    hf, directory = train_bpe(f"llama3_{ignore_merges}", LLAMA3_PATTERN, LLAMA3_SPECIALS,
                              LLAMA3_TEMPLATE, ignore_merges, "<|begin_of_text|>", "<|end_of_text|>")
    assert_same_ids(hf, directory, CORPUS)
    extra = ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n12345678<|eot_id|>"]
    assert_same_ids(hf, directory, extra)
    assert_same_ids(hf, directory, extra, no_special=True)


def test_qwen2_regex_matches_hf():
    hf, directory = train_bpe("qwen2", QWEN2_PATTERN, CHATML_SPECIALS, CHATML_TEMPLATE,
                              eos="<|im_end|>")
    assert_same_ids(hf, directory, CORPUS)
    # Qwen's tokenizer.json declares an NFC normalizer; spin uses text as given, which agrees
    # with HF on every string already in NFC.
    path = os.path.join(directory, "tokenizer.json")
    doc = json.load(open(path, encoding="utf-8"))
    doc["normalizer"] = {"type": "NFC"}
    nfc_dir = os.path.dirname(tmp_path("qwen2_nfc", "tokenizer.json"))
    with open(os.path.join(nfc_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f)
    nfc_strings = [s for s in CORPUS if unicodedata.is_normalized("NFC", s)]
    assert len(nfc_strings) >= 300
    assert_same_ids(Tokenizer.from_file(os.path.join(nfc_dir, "tokenizer.json")), nfc_dir, nfc_strings)
    ids = spin_encode_all(directory, CORPUS)
    assert spin_decode_all(directory, ids) == CORPUS


def test_added_token_strip_flags_match_hf():
    hf, _ = train_bpe("strip", QWEN2_PATTERN, CHATML_SPECIALS, CHATML_TEMPLATE)
    hf.add_special_tokens([AddedToken("<L>", lstrip=True, special=True, normalized=False),
                           AddedToken("<R>", rstrip=True, special=True, normalized=False),
                           AddedToken("<B>", lstrip=True, rstrip=True, special=True, normalized=False)])
    hf.add_tokens([AddedToken("plainword", special=False, normalized=False)])
    directory = os.path.dirname(tmp_path("strip_saved", "tokenizer.json"))
    hf.save(os.path.join(directory, "tokenizer.json"))
    strings = ["a  <L> b", "a <R>  b", "x \u3000\t<B>\n\u00a0 y", "<L><R><B>", "  <L>", "<R>  ",
               "use plainword here <|im_start|> <R> plainword<L>", "\n\n<L>\n\n<R>\n\n"]
    assert_same_ids(hf, directory, strings)
    assert_same_ids(hf, directory, strings, no_special=True)


@pytest.mark.parametrize("name,template,specials,bos", [
    ("llama3_chat", LLAMA3_TEMPLATE, LLAMA3_SPECIALS, "<|begin_of_text|>"),
    ("llama31_chat", LLAMA31_TEMPLATE, LLAMA3_SPECIALS, "<|begin_of_text|>"),
    ("chatml_chat", CHATML_TEMPLATE, CHATML_SPECIALS, None),
])
def test_chat_templates_match_jinja(name, template, specials, bos):
    _, directory = train_bpe(name, LLAMA3_PATTERN, specials, template, bos=bos)
    env = jinja2.Environment()
    for conversation in CONVERSATIONS:
        path = tmp_path("chat.json")
        with open(path, "w") as f:
            json.dump(conversation, f)
        got = json.loads(run_spin("--model", directory, "--chat-json", path, "--json").stdout)
        expected = env.from_string(template).render(messages=conversation, add_generation_prompt=True,
                                                    bos_token=bos or "")
        assert got == expected


def write_tokenizer_dir(name, doc, config=None):
    directory = os.path.dirname(tmp_path(name, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(doc, f)
    if config is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
    return directory


def minimal_doc(**overrides):
    doc = {"added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
           "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}}
    doc.update(overrides)
    return doc


@pytest.mark.parametrize("name,doc,message", [
    ("bad_pre", minimal_doc(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer type 'Whitespace'"),
    ("bad_model", minimal_doc(model={"type": "WordPiece", "vocab": {}}), "model type 'WordPiece'"),
    ("no_merges", minimal_doc(model={"type": "BPE", "vocab": {"a": 0}}), "no merges"),
    ("bad_merge", minimal_doc(model={"type": "BPE", "vocab": {"a": 0}, "merges": ["a z"]}),
     "not in the vocabulary"),
    ("bad_norm", minimal_doc(normalizer={"type": "NFKC"}), "normalizer 'NFKC'"),
    ("huge_id", minimal_doc(model={"type": "BPE", "vocab": {"a": 2**40}, "merges": []}), "out of range"),
])
def test_bad_tokenizer_json_is_a_clear_error(name, doc, message):
    directory = write_tokenizer_dir(name, doc)
    proc = run_spin("--model", directory, "--text", "ab", check=False)
    assert proc.returncode == 1
    assert message in proc.stderr.decode(), proc.stderr.decode()


def test_bad_inputs_are_clear_errors():
    proc = run_spin("--model", "/nonexistent/model.gguf", "--text", "x", check=False)
    assert proc.returncode == 1 and b"does not exist" in proc.stderr
    proc = run_spin("--model", MODEL, "--decode", "1,abc", check=False)
    assert proc.returncode == 1 and b"not a token id" in proc.stderr
    proc = run_spin("--model", MODEL, "--decode", "99999999", check=False)
    assert proc.returncode == 1 and b"out of range" in proc.stderr
    directory = write_tokenizer_dir("no_template", minimal_doc(), {"chat_template": "{{ messages }}"})
    path = tmp_path("chat.json")
    with open(path, "w") as f:
        json.dump(CONVERSATIONS[0], f)
    proc = run_spin("--model", directory, "--chat-json", path, check=False)
    assert proc.returncode == 1 and b"unknown chat template" in proc.stderr


def test_directory_inputs_are_clear_errors():
    directory = os.path.dirname(tmp_path("any"))
    for flag in ("--file", "--jsonl-in", "--decode-jsonl", "--chat-json"):
        proc = run_spin("--model", MODEL, flag, directory, check=False)
        assert proc.returncode == 1 and f"'{directory}' is a directory".encode() in proc.stderr, \
            (flag, proc.stderr)
    # A pipe is not a regular file either, and still reads.
    proc = subprocess.run([SPIN, "tokenize", "--model", MODEL, "--jsonl-in", "/dev/stdin"], input=b'"hi"\n',
                          capture_output=True, timeout=120)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)) >= 1, proc.stderr
