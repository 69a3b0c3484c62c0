"""The Python API's parts below `LLM` (batchgen/llm.py), under vLLM's names: its engine arguments,
`SamplingParams`, the prompts' checks and the `RequestOutput`s it returns."""
