-- A preview URL's tunnel (sandboxes.expose): the ticket names the guest port the host connects
-- the stream to instead of the guest's sshd. NULL: an exec tunnel, as before.
ALTER TABLE exec_tickets ADD COLUMN port integer;
