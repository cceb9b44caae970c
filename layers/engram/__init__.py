"""DeepSeek-V4.1's Engram memory: hashed n-gram rows from two huge fp8 tables, a projection and a
gate on the residual stream (``docs/ENGRAM.md``). A model package beside ``layers.ngram_embed``:
neither imports the other; what both need lives below them (``layers.ngram_store``, ``layers.ops``)."""
