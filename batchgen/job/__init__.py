"""One job, resolved and checked before any weight loads: its options (config.py), the model
and engine it runs on (model_spec.py), its input opened and its rows prepared into requests
(open.py, prepare.py, row_options.py, tokenization.py, seeds.py), which rows are its shard
(shard.py) and what makes a rerun the same job (fingerprint.py)."""
