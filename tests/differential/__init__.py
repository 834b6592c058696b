"""A differential program fuzzer: random programs of torch.distributed collectives run on backend
"passing" and on gloo, compared by machine (program.py: the programs; rank.py: one rank process;
oracle.py: the driver, the comparison and the CLI behind `make fuzz-torch`)."""
