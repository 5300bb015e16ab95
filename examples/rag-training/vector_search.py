"""Vector search unit of the rag-training example (a stand-in: prints what it would do)."""

print("vector-search: nearest neighbours for each query")
