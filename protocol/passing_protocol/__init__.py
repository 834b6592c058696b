"""PASSING control protocol: what the host agent (``passing``) and the controller
(``passing_controller``) both speak, in one place.

* ``keys``: CURVE key files, a client's keys, a CURVE server socket with an allow-list (docs/security.md);
* ``rpc``: one JSON request/reply over ZeroMQ, and the strict reading of a control message and of its
  fields, with ``MessageError`` for whatever fails (docs/control.md);
* ``metrics``: the Prometheus HTTP server of ``--metrics ADDR:PORT``.

Which commands exist, what each one's fields are, who may send it, and which keys a service admits
are each side's own (``passing.aggregator``, ``passing.keys``; ``passing_controller.service``,
``passing_controller.schema``, ``passing_controller.keys``).
"""

__version__ = "0.1.0"
