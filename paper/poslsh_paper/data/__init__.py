"""Real text, offline: Debian documentation packages as document-level corpora."""
from poslsh_paper.data.corpus import (CORPORA, CorpusNotFound, Document, available_corpora, corpus_files,
                     iter_documents, load_documents, split_documents)

__all__ = ["CORPORA", "CorpusNotFound", "Document", "available_corpora", "corpus_files",
           "iter_documents", "load_documents", "split_documents"]
