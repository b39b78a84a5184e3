"""The only code that touches checkpoint bytes: headers, ranged reads with a ledger, writes."""
