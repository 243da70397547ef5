"""Rate limits per tenant: what a request is estimated to take, and the buckets it is admitted against."""
