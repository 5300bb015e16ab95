"""Embedding generation unit of the rag-training example (a stand-in: prints what it would do)."""

print("embedding-gen: embedding the corpus in batches")
