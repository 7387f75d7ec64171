"""Generated gRPC contracts (run `make proto` after editing a .proto file)."""
