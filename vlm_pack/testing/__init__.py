"""Fixtures for tests, the demo, examples and benchmarks: tiny random models built from configs, offline processors
(the shipped Qwen tokenizer, transformers' own image processors, official chat templates) and sample data (real
photos, easy-vqa pairs, chats). The library itself never imports this package (``tests/test_public_api.py``
checks it); ``vlm-pack demo`` does, as a user of the library would.
"""
