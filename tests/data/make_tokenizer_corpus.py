#!/usr/bin/env python3
"""Writes tokenizer_corpus.jsonl (one JSON string per line) beside this script.

The corpus feeds the tokenizer tests (spin vs HF tokenizers). Deterministic: re-running it
rewrites the same file. Strings are written here by hand, plus systematic families (digit runs,
whitespace runs, every Unicode space character, emoji sequences) generated below.
"""
import json
import os
import random

HAND_WRITTEN = [
    # English prose
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times; nobody quite agreed which.",
    "She said, \"I'll be there at noon,\" and then she wasn't.",
    "Don't stop believing; we'll see what they're doing and what you've done.",
    "I'm sure he'd have come if it hadn't rained. THEY'RE LATE. We'LL See. You'Ve Been WARNED.",
    "A long sentence with many commas, semicolons; colons: dashes - and em-dashes \u2014 plus ellipses\u2026",
    "Numbers like 3.14159, 2,718 and 1e-9 appear in text, as do versions like v1.2.3-rc4.",
    "Mr. O'Neill's dog's bone's gone.",
    "   leading spaces and trailing spaces   ",
    "\n\nStarts with newlines and ends with them\n\n",
    "Tabs\tbetween\twords\tand\t\ttwo tabs",
    "Mixed \t \n \r\n whitespace \u00a0 with a non-breaking space",
    "Windows line endings\r\nare here\r\nand here\r\n",
    "",
    " ",
    "a",
    "I",
    "'s",
    "'S 'T 'RE 'VE 'M 'LL 'D",
    "x's y't z're w've v'm u'll t'd",
    "rock'n'roll isn't ''quoted'' ' s",
    "ALL CAPS SHOUTING TEXT WITH NUMBERS 123 AND PUNCTUATION!!!",
    "camelCaseIdentifier snake_case_identifier kebab-case-identifier SCREAMING_SNAKE",
    "Hyphenated-words, e-mail, co-operate, re-enter.",
    "The year 1999 and 2024; 10,000,000 people; 0.000001 percent.",
    "Phone: +1 (555) 123-4567, ext. 89",
    "Email me at someone.name+tag@example.co.uk please.",
    "https://www.example.com/path/to/page?query=value&other=42#section-3",
    "Visit http://localhost:8080/api/v1/users/123/profile?fields=name,email or ftp://files.example.org/pub.",
    "git clone git@github.com:example/repo.git && cd repo && make -j2",
    "C:\\Program Files\\App\\bin\\app.exe --flag=\"value with spaces\"",
    "/usr/local/lib/python3.11/site-packages/numpy/__init__.py",
    # code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, x):\n        self._items.append(x)\n",
    "import numpy as np\nx = np.arange(10).reshape(2, 5)\nprint(x.T @ x)\n",
    "#include <stdio.h>\n\nint main(void) {\n\tprintf(\"Hello, %s!\\n\", \"world\");\n\treturn 0;\n}\n",
    "template <typename T>\nstd::vector<T> twice(const std::vector<T>& v) {\n  std::vector<T> out;\n  for (auto& x : v) out.push_back(2 * x);\n  return out;\n}\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfor i := 0; i < 3; i++ {\n\t\tfmt.Println(i)\n\t}\n}\n",
    "const add = (a, b) => a + b;\nconsole.log(`sum: ${add(2, 3)}`);\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE 'A%' ORDER BY id DESC LIMIT 10;",
    "<html>\n  <body>\n    <div class=\"main\" id='x'>Hi &amp; bye</div>\n  </body>\n</html>\n",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\"\ndone\n",
    "public static void main(String[] args) { System.out.println(\"Java\"); }",
    "x <<= 2; y >>= 3; z ||= w; a ??= b; c **= 2; d //= 4; e != f; g === h; i !== j;",
    "if (a&&b||!c) { return a?b:c; } else { throw new Error('bad'); }",
    "matrix[i][j] += alpha * A[i][k] * B[k][j];  // inner loop",
    "%macro PUSH 1\n    push %1\n%endmacro\n\tmov eax, [ebp+8]\n",
    "(defun square (x) (* x x))\n(mapcar #'square '(1 2 3))",
    "main :: IO ()\nmain = mapM_ print [x | x <- [1..10], even x]\n",
    "    \n\t\n    \n",
    "    indented with four spaces\n        eight spaces\n\t\ttwo tabs\n",
    "{\"name\": \"spin\", \"version\": [0, 1, 0], \"nested\": {\"a\": null, \"b\": true, \"c\": -1.5e3}}",
    "[{\"id\":1,\"tags\":[\"x\",\"y\"]},{\"id\":2,\"tags\":[]}]",
    "key: value\nlist:\n  - one\n  - two\nmap:\n  inner: 3\n",
    "[section]\nname = \"toml\"\nnumbers = [1, 2, 3]\n",
    # markdown
    "# Title\n\n## Subtitle\n\n- item one\n- item two\n  - nested item\n\n1. first\n2. second\n",
    "**bold** and *italic* and `code` and ~~strike~~ and [link](https://example.com).",
    "```python\nprint('fenced')\n```\n\n> quoted text\n> more quote\n",
    "| col a | col b |\n|-------|-------|\n| 1     | 2     |\n",
    "---\n***\n___\n",
    "Inline math $E = mc^2$ and display $$\\int_0^\\infty e^{-x^2} dx = \\frac{\\sqrt{\\pi}}{2}$$",
    # CJK
    "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u6563\u6b65\u5427\u3002",
    "\u673a\u5668\u5b66\u4e60\u662f\u4eba\u5de5\u667a\u80fd\u7684\u4e00\u4e2a\u5206\u652f\u3002\u6df1\u5ea6\u5b66\u4e60\u4f7f\u7528\u795e\u7ecf\u7f51\u7edc\u3002",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002\u3072\u3089\u304c\u306a\u3068\u30ab\u30bf\u30ab\u30ca\u3068\u6f22\u5b57\u3092\u4f7f\u3044\u307e\u3059\u3002",
    "\u6771\u4eac\u30bf\u30ef\u30fc\u306f1958\u5e74\u306b\u5b8c\u6210\u3057\u307e\u3057\u305f\u3002",
    "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc785\ub2c8\ub2e4. \uc11c\uc6b8\uc740 \ub300\ud55c\ubbfc\uad6d\uc758 \uc218\ub3c4\uc785\ub2c8\ub2e4.",
    "\u4e2d\u6587English\u6df7\u5408mixed\u6587\u672ctext123\u6570\u5b57",
    "\uff21\uff22\uff23\uff11\uff12\uff13 full-width letters and digits\uff01",
    "\u3000\u3000ideographic spaces\u3000between\u3000words",
    # Arabic, Hebrew, Hindi, other scripts
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645! \u0643\u064a\u0641 \u062d\u0627\u0644\u0643 \u0627\u0644\u064a\u0648\u0645\u061f",
    "\u0627\u0644\u0644\u063a\u0629 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u062a\u0643\u062a\u0628 \u0645\u0646 \u0627\u0644\u064a\u0645\u064a\u0646 \u0625\u0644\u0649 \u0627\u0644\u064a\u0633\u0627\u0631 \u0661\u0662\u0663\u0664",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd, \u05de\u05d4 \u05e9\u05dc\u05d5\u05de\u05da?",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e! \u092f\u0939 \u0939\u093f\u0902\u0926\u0940 \u092e\u0947\u0902 \u090f\u0915 \u0935\u093e\u0915\u094d\u092f \u0939\u0948\u0964 \u0967\u0968\u0969",
    "\u0d2e\u0d32\u0d2f\u0d3e\u0d33\u0d02 \u0ba4\u0bae\u0bbf\u0bb4\u0bcd \u0c24\u0c46\u0c32\u0c41\u0c17\u0c41 \u09ac\u09be\u0982\u09b2\u09be",
    "\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439, \u043c\u0438\u0440! \u042d\u0442\u043e \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442.",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5! \u03b1\u03b2\u03b3\u03b4 \u03a9\u03bc\u03ad\u03b3\u03b1",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22\u0e44\u0e21\u0e48\u0e21\u0e35\u0e0a\u0e48\u0e2d\u0e07\u0e27\u0e48\u0e32\u0e07",
    "\u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8 \u0540\u0561\u0575\u0565\u0580\u0565\u0576 \u12a0\u121b\u122d\u129b",
    "Vi\u1ec7t Nam, ti\u1ebfng Vi\u1ec7t c\u00f3 nhi\u1ec1u d\u1ea5u.",
    "Stra\u00dfe, \u00e4\u00f6\u00fc \u00c4\u00d6\u00dc, fa\u00e7ade, na\u00efve, caf\u00e9, se\u00f1or, \u0141\u00f3d\u017a, \u010cesk\u00fd",
    "\u0130stanbul \u0131\u015f\u0131k \u011f\u00fc\u00e7l\u00fc \u015feker",
    # combining marks
    "e\u0301 a\u0300 o\u0308 n\u0303 (combining accents vs precomposed \u00e9 \u00e0 \u00f6 \u00f1)",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O\u0342\u030c\u030c\u0358\u0328\u0335\u0339\u033b\u031d\u0333",
    "\u0915\u094d\u0937 \u0924\u094d\u0930 \u091c\u094d\u091e \u0936\u094d\u0930",
    "a\u200bb\u200cc\u200dd\u2060e\ufeffF",
    "soft\u00adhyphen and word\u2011joiner\u2010dash",
    # emoji
    "I love pizza \U0001F355 and tacos \U0001F32E!",
    "\U0001F600\U0001F603\U0001F604\U0001F601\U0001F606\U0001F605\U0001F923\U0001F602",
    "Family: \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 and couple \U0001F469\u200d\u2764\ufe0f\u200d\U0001F468",
    "Skin tones: \U0001F44B\U0001F3FB \U0001F44B\U0001F3FC \U0001F44B\U0001F3FD \U0001F44B\U0001F3FE \U0001F44B\U0001F3FF",
    "Flags: \U0001F1FA\U0001F1F8 \U0001F1EF\U0001F1F5 \U0001F1E9\U0001F1EA \U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F",
    "Keycaps: 1\ufe0f\u20e3 #\ufe0f\u20e3 *\ufe0f\u20e3 and hearts \u2764\ufe0f \u2665 \u2661",
    "\U0001F9D1\u200d\U0001F4BB coding, \U0001F3F3\ufe0f\u200d\U0001F308 rainbow, \U0001F415\u200d\U0001F9BA service dog",
    "Math symbols: \u2200x\u2208\u211d, \u2203y: x\u00b2+y\u00b2\u2264\u03c0 \u2192 \u221e \u2260 \u2248 \u2211 \u220f \u221a",
    "Currency: $100 \u20ac50 \u00a330 \u00a51000 \u20b9200 \u20bf0.5",
    "Box drawing: \u250c\u2500\u2500\u2510\n\u2502  \u2502\n\u2514\u2500\u2500\u2518",
    "Music \U0001D11E \U0001D160 and old italic \U00010300\U00010301 and cuneiform \U00012000",
    "Private use \ue000\uf8ff and specials \ufffc \ufffd",
    # special tokens embedded in text
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "text<|endoftext|>more text<|endoftext|>",
    "<|endoftext|><|endoftext|><|endoftext|>",
    "almost special: <|im_start and im_start|> and <|im_end| and <| im_end |>",
    "<repo_name>spin<file_sep>src/main.cpp<gh_stars>100",
    "<jupyter_start><jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<<|im_start|>|im_end|>>",
    "<|im_start|><|im_start|>x<|im_end|><|im_end|>",
    "   <|im_start|>   spaced   <|im_end|>   ",
    "<|im_start|>",
    "<s></s><unk><pad>[CLS][SEP][MASK]",
    # misc
    "!!!???...,,,;;;:::---___+++===***&&&^^^%%%$$$###@@@~~~```|||\\\\\\///",
    "'''\"\"\"```",
    "(((nested))) [[[brackets]]] {{{braces}}} <<<angles>>>",
    "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "Llanfairpwllgwyngyllgogerychwyrndrobwllllantysiliogogogoch",
    "The\u2019s curly apostrophe\u2019ll differ from the straight one's",
    "\u201cSmart quotes\u201d and \u2018single ones\u2019 and \u00abguillemets\u00bb and \u201egerman\u201c",
    "0123456789 9876543210 00000 1234567890123",
    "0x1F 0b1010 0o777 1_000_000 3.0f 1e10 -0.0 +inf NaN",
    "12:34:56 2024-01-31T23:59:59Z 1/2/2003",
    "\u2160\u2161\u2162 roman numerals, \u00bd \u00bc \u00be fractions, \u00b2\u00b3 superscripts, \u2460\u2461\u2462 circled",
    "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669 Arabic-Indic and \u0966\u0967\u0968 Devanagari and \uff10\uff11 full-width digits",
    "a\x00b\x01c\x1fd\x7fe",
    "bell\x07 backspace\x08 formfeed\x0c vertical\x0b tab",
    "\x1c\x1d\x1e\x1f separators",
    "line\u2028separator and paragraph\u2029separator and next\x85line",
]


def generated():
    out = []
    # Digit runs of every length 1..40 (the Llama-3 pattern groups them by three).
    for n in range(1, 41):
        out.append("".join(str((i * 7 + n) % 10) for i in range(n)))
    for n in (1, 2, 3, 4, 5, 6, 7, 9, 12, 17, 25, 64):
        out.append(f"value {'9' * n} and a{'0' * n}b")
    # Whitespace runs of many lengths and mixes, before words, at ends, alone.
    for n in (1, 2, 3, 4, 5, 8, 16, 33, 100, 1000):
        out.append(" " * n)
        out.append("x" + " " * n + "y")
        out.append("word" + " " * n)
        out.append("\t" * n + "tabbed")
        out.append("\n" * min(n, 50) + "after newlines")
    for mix in (" \n", "\n ", "\t\n", " \t ", "\r\n\r\n", " \n\n ", "\n\t\t", "  \n  \n"):
        out.append(f"a{mix}b{mix * 3}c{mix}")
    # Every Unicode space separator and the other characters regex engines disagree about.
    spaces = ["\u00a0", "\u1680", "\u2000", "\u2001", "\u2002", "\u2003", "\u2004", "\u2005",
              "\u2006", "\u2007", "\u2008", "\u2009", "\u200a", "\u202f", "\u205f", "\u3000",
              "\u180e", "\u200b", "\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\ufeff"]
    for s in spaces:
        out.append(f"a{s}b {s}c{s}{s}d{s} ")
    out.append("".join(spaces))
    # Emoji sequences combined with text and digits.
    emoji = ["\U0001F44D", "\U0001F44D\U0001F3FD", "\U0001F469\u200d\U0001F52C", "\u2764\ufe0f",
             "\U0001F1EC\U0001F1E7", "\U0001F9D1\U0001F3FF\u200d\U0001F91D\u200d\U0001F9D1\U0001F3FB"]
    for i, e in enumerate(emoji):
        out.append(f"{e}")
        out.append(f"ok{e}{i}{e} {e}s")
    # Contractions in every case and with neighbours.
    for c in ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d"):
        out.append(f"it{c} IT{c.upper()} It{c.capitalize()} {c} {c}{c} x{c}y")
    # Very long words and repeated structure.
    out.append("supercalifragilisticexpialidocious" * 20)
    out.append("ab" * 500)
    out.append("\u00e9" * 300)
    out.append("\u4e2d" * 400)
    out.append("\U0001F600" * 100)
    out.append("-" * 200 + "=" * 200)
    # Pseudo-random mixtures drawn from a fixed alphabet (seeded: the corpus is fixed).
    rng = random.Random(1234)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") +
                list(" \t\n\r.,;:!?'\"()[]{}<>-_+=*/\\|@#$%^&~`") +
                ["\u00e9", "\u00df", "\u4e2d", "\u6587", "\u0639", "\u0628", "\u0928", "\u094d",
                 "\U0001F600", "\u200d", "\u0301", "\u00a0", "\u3000", "\u0663", "'s", "'ll",
                 "<|im_start|>", "<|im_end|>", "<|endoftext|>", "  ", "\n\n"])
    for _ in range(120):
        n = rng.randint(1, 80)
        out.append("".join(rng.choice(alphabet) for _ in range(n)))
    return out


def main():
    corpus = HAND_WRITTEN + generated()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer_corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for s in corpus:
            f.write(json.dumps(s, ensure_ascii=True) + "\n")
    print(f"wrote {len(corpus)} strings to {path}")


if __name__ == "__main__":
    main()
