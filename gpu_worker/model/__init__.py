"""The Llama-family decoder, run on one flat [tokens x hidden] batch (article 04)."""
