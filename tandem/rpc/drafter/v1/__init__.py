# The drafter protocol's version, which Hello and Welcome carry: the verifier and the drafter refuse a
# peer that speaks another. Bump it whenever what a Round or a Drafts message means changes
# (2: trees packed in the Drafts reply; 3: prefix caching — Extend.prefix and release_after; 4: the round
# mailbox's flags are 64-bit). One definition for both services.
PROTOCOL_VERSION = 4
