"""The research lab around exgrpo-trl: the study, Countdown, the warm-start cache and the demo, and their tests
(`lab/tests`, run by `make test`). Not part of the installed package; run from the repository root
(`python -m lab.study`, `python -m lab.demo`, `make demo`)."""
