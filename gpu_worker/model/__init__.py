"""The Llama-family decoder, run on one flat [tokens x hidden] batch
(docs/design.md#one-flat-batch)."""
