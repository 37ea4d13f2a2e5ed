"""Data for fpa_jax: tf-free TFDS builders, grain pipelines and tokenizers.

    p = make_pipeline("scopes", data_dir="data", seq_len=256, batch_size=8, small=True)
    batch = next(p)  # inputs/targets/segment_ids int32 [8, 256], loss_mask float32 [8, 256]
    state = p.get_state(); ...; p.set_state(state)  # exact resume

Build everything ahead of time with `python -m fpa_jax.data.prepare --data-dir DIR [--small]`.
"""

from fpa_jax.data.passkey import eval_split_name, passkey_eval_examples
from fpa_jax.data.pipeline import KEYS, TASKS, Pipeline, make_pipeline
from fpa_jax.data.tokenizers import ByteTokenizer, SpmTokenizer, get_tokenizer

__all__ = ["TASKS", "KEYS", "Pipeline", "make_pipeline", "get_tokenizer", "ByteTokenizer",
           "SpmTokenizer", "eval_split_name", "passkey_eval_examples"]
