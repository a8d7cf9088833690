"""The packaged all-MiniLM-L6-v2 and sentence-transformers over the same directory, loaded once per test run."""
from functools import cache

import pytest

from inferd.models.sentence import EmbeddingModelFiles, load_embedding_model

WORDS = ("the river carried small boats past old stone houses while children watched from bridges and "
         "merchants counted coins beside baskets of apples pears bread cheese wool and painted pottery").split()


def text(num_words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i * 7) % len(WORDS)] for i in range(num_words)) + "."


# short and long, punctuation, case, accents, digits and a word WordPiece splits
TEXTS = ["Hello", "What is the capital of France?", "Ünïcödé façade, naïve café: 42 résumés!",
         "antidisestablishmentarianism", text(12), text(40, 3), text(150, 5), "A B C d e f. " * 9]


@cache
def minilm_files() -> EmbeddingModelFiles:
    return load_embedding_model()


@cache
def sentence_transformer():
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm_files().directory), device="cpu")
