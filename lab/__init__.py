"""The research lab around exgrpo-trl: the toy tasks, the study and the demo. Not part of the installed package;
run from the repository root (`python -m lab.study`, `python -m lab.demo`, `make demo`)."""
