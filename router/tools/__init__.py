"""Tools beside the server: router ctl, router bench, the fake replica."""
