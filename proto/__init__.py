"""The contracts: .proto files in pagedserve/v1/ beside their stubs, imported as pagedserve.v1, and the
generator of those stubs (run `make proto` after editing a .proto file)."""
