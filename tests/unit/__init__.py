"""Pure rules, and the engine in this process on the inline or a hand-driven transport with
`local` admission: no subprocess."""
