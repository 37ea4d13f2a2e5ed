"""Data for fpa_jax: tf-free TFDS builders, grain pipelines and tokenizers.

    p = make_pipeline("scopes", data_dir="data", seq_len=256, batch_size=8, small=True)
    batch = next(p)  # inputs/targets/segment_ids int32 [8, 256], loss_mask float32 [8, 256]
    state = p.get_state(); ...; p.set_state(state)  # exact resume

Build everything ahead of time with `python -m fpa_jax.data.prepare --data-dir DIR [--small]`.

Modules in layers; each imports only from the layers before it (tests/repo/test_imports.py checks):
  1. tokenizers                                   bytes and SentencePiece
  2. scopes, dips, passkey, synthetic, bindings   task generators (numpy; bindings: in-memory LM
                                                  batches of nested named bindings)
  3. text, windows                                text corpus listing and split; token files as windows
  4. builders                                     TFDS builders (tensorflow_datasets from here on)
  5. sources                                      building once per job, opening splits, spm training
  5. niah                                         RULER-style retrieval tasks, scoring, the `fpa_niah` builder
  6. pipeline                                     grain pipelines, `make_pipeline`
  7. prepare                                      the CLI
"""

import importlib

# Public name -> its module, imported on first use (PEP 562): `import fpa_jax.data.tokenizers`
# must not pull grain and tensorflow_datasets in through this package.
_EXPORTS = {
  "TASKS": "pipeline",
  "KEYS": "pipeline",
  "Pipeline": "pipeline",
  "make_pipeline": "pipeline",
  "make_heldout": "pipeline",
  "get_tokenizer": "sources",
  "ByteTokenizer": "tokenizers",
  "SpmTokenizer": "tokenizers",
  "eval_split_name": "passkey",
  "passkey_eval_examples": "passkey",
  "SyntheticPipeline": "synthetic",
  "RETRIEVAL_TASKS": "niah",
  "RetrievalExample": "niah",
  "retrieval_example": "niah",
  "retrieval_eval_examples": "niah",
  "score_answers": "niah",
  "teacher_forced_correct": "niah",
  "niah_data_source": "niah",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
