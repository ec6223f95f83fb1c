"""Reference drafters, one module per family, each a `losscheck.core.contract.Drafter`."""
