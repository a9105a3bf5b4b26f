"""Operations on finished or stuck batches: inspection, retention and retry rounds."""
