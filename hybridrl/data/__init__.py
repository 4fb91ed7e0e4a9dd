"""Prompt datasets: the built-in arithmetic task, its tokenizer, and jsonl/parquet files."""
