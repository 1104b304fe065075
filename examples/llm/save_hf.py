"""Save the decoders of examples/make_llms.py as Hugging Face model folders (config + weights).

    /path/to/venv/bin/python examples/llm/save_hf.py --out models/llm_hf [--only llama,...]

Needs torch and transformers (as make_llms.py). Each family is built exactly as make_llms.py
builds it before exporting — its per-family seed, its config, the same perturbation of constant
parameters — so OUT/NAME/ holds the same weights as models/llm/NAME.onnx. Tools that read a
local Hugging Face folder (onnxruntime-genai's model builder: ``python -m
onnxruntime_genai.models.builder -i OUT/NAME -o DIR -p fp32 -e cpu``) then start from the same
model as the ONNX exports; ``examples/llm/bench_llm.py --genai`` compares their logits.

The builder also loads a tokenizer from the folder (for the generation config's special token
ids). None of these models has one, so a word-level tokenizer over the config's vocabulary
(tokens ``t0`` … ``tN``, ``<unk>``/``<s>``/``</s>`` first) is saved with it: it names the
vocabulary and changes nothing in the graph.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples/: make_llms, export_utils

import torch  # noqa: E402
from export_utils import perturb_constant_params, quiet_warnings, seed_all, seed_for  # noqa: E402
from make_llms import FAMILIES  # noqa: E402


def save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level fast tokenizer of ``vocab_size`` tokens, saved into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def save_family(name: str, out: str) -> str:
    """Build family ``name`` as make_llms.py does and save it under ``out/name``."""
    fam = next((f for f in FAMILIES if f.name == name), None)
    if fam is None:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")
    seed_all(seed_for(fam.name))
    model = fam.build().eval()
    with torch.no_grad():
        perturb_constant_params(model)
    path = os.path.join(out, fam.name)
    model.save_pretrained(path)
    save_tokenizer(path, model.config.vocab_size)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for one HF folder per family")
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    args = ap.parse_args()
    wanted = [s for s in args.only.split(",") if s] or [f.name for f in FAMILIES]
    unknown = sorted(set(wanted) - {f.name for f in FAMILIES})
    if unknown:
        print(f"error: unknown families {unknown}", file=sys.stderr)
        return 2
    quiet_warnings()
    for name in wanted:
        print(save_family(name, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
