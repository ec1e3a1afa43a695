"""The research tooling: studies, sweeps and workload generators, built on the product
(`sao_actor_learner`) but not part of it; the product's wheel does not ship it.

  sweeps.py        grids of runs (methods x shapes x staleness x seeds), results.csv, plots
  studies/         the reproduction study's presets, statistics, tables, plots, process pool
  sweep_presets/   the staleness, value-pretraining and online-shift sweeps
  workloads/       generated workloads: word problems, a tiny BPE tokenizer, chat SFT data
  benchmarks/      the benchmarks' libraries: the generate-call log, budget-curve math

One entry point runs every study and sweep: `programs/study.py --preset=...`. The other entry
points (programs/make_dataset.py, make_tiny_model.py, sft_dataset.py, programs/benchmarks/) import
what they need from here. Run from the repository root (the programs put it on sys.path).
"""
