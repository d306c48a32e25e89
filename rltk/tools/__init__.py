"""Tools the policy can call and the parsers that find its calls (kinds ``tool`` and ``tool_parser``)."""
