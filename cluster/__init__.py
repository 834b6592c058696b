"""Local deployments of PASSING for the demo, the tests and the benchmarks.

``local``: software aggregators and a controller on one machine, and rank processes
laid out as s servers × n ranks the way torchrun would start them.
``netns``: an emulated cluster in network namespaces (root), or racks of them under leaves and a spine.
``racks``: the aggregators and the controller of a cluster of racks (a PS leaf per rack, a PS root, spares).
``processes``: how both stop what they started.
"""
