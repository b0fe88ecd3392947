"""ALiBi encoders loaded natively: MosaicBERT, DNABERT-2 and Jina-BERT-v2 (docs/encoders.md).

``load_alibi_encoder(path)`` reads a checkpoint as its original code saves it, without running any
of its code, and returns the encoder (and its MLM or classification head) attending over the
unpadded tokens through the window op: exact ALiBi, fixed windows or certified windows.
"""
from .family import EncoderConfig
from .load import load_alibi_encoder, read_state_dict
from .model import AlibiEncoderForMaskedLM, AlibiEncoderForSequenceClassification, AlibiEncoderModel, EncoderOutput
from .pooling import pool_embeddings

__all__ = ["load_alibi_encoder", "pool_embeddings", "read_state_dict", "EncoderConfig", "EncoderOutput",
           "AlibiEncoderModel", "AlibiEncoderForMaskedLM", "AlibiEncoderForSequenceClassification"]
