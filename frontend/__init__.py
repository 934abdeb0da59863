"""HTTP front-end of shmbroker: the KServe v2 / Triton HTTP protocol, answered from the rings."""
