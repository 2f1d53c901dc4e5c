"""kvroute as the endpoint picker of an inference gateway (Envoy ext_proc, ``--epp-port``)."""
