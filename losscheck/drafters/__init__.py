"""Reference drafters, one module per family, each a `losscheck.contract.Drafter`."""
