"""Generated workloads: GSM8K-style word problems, a tiny BPE tokenizer, chat SFT."""
