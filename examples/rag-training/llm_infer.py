"""LLM inference unit of the rag-training example (a stand-in: prints what it would do)."""

print("llm-inference: answering with retrieved context")
