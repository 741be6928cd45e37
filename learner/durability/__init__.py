"""What the learner makes durable and visible: checkpoints (`checkpoint`, their tensors in
`checkpoint_io`), the ledger of every entry's fate (`ledger`), and published weight versions
(`publish`, in a helper process: `publish_process`)."""
