"""The software aggregator (the PS fallback, and the switch's stand-in in tests and benchmarks):

* ``engine``: the aggregation state machine, pure numpy, no I/O (the specification);
* ``native_engine``: the same engine in C, behind the same API, and ``make_engine``;
* ``server``: either engine behind a UDP socket, with its control socket (SoftwareAggregator);
* ``control_channel``: that socket's protocol: job objects, the configuration file, ControlClient.
"""
