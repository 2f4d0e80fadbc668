"""GGUF fuzzing harness: structure-aware mutants of a tiny target and drafter, each loaded and run
in a child process; any signal, hang, or exception other than ValueError / RuntimeError /
MemoryError is a finding. `python -m tests.fuzz --n 5000` from the repo root for a long run;
test_fuzz.py runs a bounded seeded one in the test suite."""
