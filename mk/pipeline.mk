# Pipeline examples on the embedded default model, included by the Makefile:
#
#   make label        prepare (sample the shipped reviews) -> run in 2 shards -> merge -> report
#                     the label accuracy against the true labels, and the throughput
#   make summarize    the same for jobs/summarize.yaml: summaries vs the reference ones
#   make -j2 label    the two shards side by side (each shard is its own make target)
#   make pipeline-clean
#
# Each step is a file target, so an interrupted pipeline picks up where it stopped, and a shard
# that was stopped midway resumes its own rows. On a cluster the run step is
# `batchgen slurm jobs/label_sentiment_choice.yaml --shards N ...` instead; prepare, merge and
# report stay the same.

# The run step's shards, as batchgen names their directories (shard I of N: shard-IIIII-of-NNNNN).
SHARD_NAMES     := shard-00000-of-00002 shard-00001-of-00002
LABEL_ROWS      ?= 200
SUMMARIZE_ROWS  ?= 40
# Extra `batchgen run` flags for the run steps (compile is already on with a GPU, off on a CPU).
PIPELINE_FLAGS  ?=

.PHONY: label summarize pipeline-clean

# ---- label: jobs/label_sentiment_choice.yaml (labels held to --choice) over a sample ------
LABEL := out/label

label: $(LABEL)/run/.batchgen/SUCCESS
	$(BIN)/python scripts/pipeline.py report label $(LABEL)/run

# A new input invalidates earlier results, so the run directory goes with it.
$(LABEL)/input.parquet: scripts/pipeline.py | install
	rm -rf $(LABEL)/run
	$(BIN)/python scripts/pipeline.py prepare --rows $(LABEL_ROWS) --out $@

$(LABEL)/run/shard-%/.batchgen/SUCCESS: $(LABEL)/input.parquet jobs/label_sentiment_choice.yaml
	$(BIN)/batchgen run jobs/label_sentiment_choice.yaml --input $< --output $(LABEL)/run \
		--shard $$(echo $* | sed 's/^0*\([0-9]\)/\1/; s/-of-0*/\//') --quiet $(PIPELINE_FLAGS)

$(LABEL)/run/.batchgen/SUCCESS: $(foreach s,$(SHARD_NAMES),$(LABEL)/run/$(s)/.batchgen/SUCCESS)
	$(BIN)/batchgen merge $(LABEL)/run

# ---- summarize: jobs/summarize.yaml over the first reviews ----------------------------------
SUMMARIZE := out/summarize-pipeline

summarize: $(SUMMARIZE)/run/.batchgen/SUCCESS
	$(BIN)/python scripts/pipeline.py report summary $(SUMMARIZE)/run

$(SUMMARIZE)/input.parquet: scripts/pipeline.py | install
	rm -rf $(SUMMARIZE)/run
	$(BIN)/python scripts/pipeline.py prepare --rows $(SUMMARIZE_ROWS) --out $@

$(SUMMARIZE)/run/shard-%/.batchgen/SUCCESS: $(SUMMARIZE)/input.parquet jobs/summarize.yaml
	$(BIN)/batchgen run jobs/summarize.yaml --input $< --output $(SUMMARIZE)/run \
		--shard $$(echo $* | sed 's/^0*\([0-9]\)/\1/; s/-of-0*/\//') --quiet $(PIPELINE_FLAGS)

$(SUMMARIZE)/run/.batchgen/SUCCESS: $(foreach s,$(SHARD_NAMES),$(SUMMARIZE)/run/$(s)/.batchgen/SUCCESS)
	$(BIN)/batchgen merge $(SUMMARIZE)/run

pipeline-clean:
	rm -rf $(LABEL) $(SUMMARIZE)
