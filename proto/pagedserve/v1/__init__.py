"""The contracts' generated stubs (package pagedserve.v1): `from pagedserve.v1 import worker_pb2`."""
