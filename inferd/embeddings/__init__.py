"""The embedding kind's replica: our BERT behind the dynamic batcher, served as OpenAI's /v1/embeddings."""
